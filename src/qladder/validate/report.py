"""report.md and report.html from results.json (whose figures come from outcomes.jsonl, see
`qladder.validate.recompute`) and, in-process, boundaries.json: the side-by-side tables, the
verdicts, the three boundaries, the method. Both are built from one list of blocks (heading, text,
table, image); the HTML embeds the PNGs as base64 so the single file can be mailed or opened
anywhere, the PNGs are also kept beside it.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qladder.validate import plots
from qladder.validate.outcome import read_jsonl

Block = tuple[str, Any]  # ("h2", text) | ("p", text) | ("table", (header, rows)) | ("img", (file, alt))


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and x == float("inf"):
        return "inf"
    return fmt.format(x) if isinstance(x, int | float) else str(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _shares(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in d.items()) or "n/a"


def _r(x: Any) -> str:
    return _f(x, "{:.3f}")


def _count(row: dict[str, Any], key: str) -> str:
    if not row:
        return "n/a"
    return f"{row[key]} ({_pct(row[key + '_rate'])})"


ROWS = (("answered clean", "answered_clean"), ("garbage (raw)", "garbage"),
        ("stopped (the guard ended it short of fp32's answer)", "stopped"),
        ("... garbage or stopped fp32 alone gives too (the model's own)", "garbage_fp32_identical"),
        ("garbage or stopped beyond fp32's own (net)", "garbage_net"), ("safe fallback answers", "fallback"),
        ("5xx (errors, timeouts, dropped connections)", "five_xx"), ("4xx (refused)", "four_xx"),
        ("unjudged (likelihood not computed)", "unjudged"))


def split_table(f: dict[str, Any], labels: tuple[str, str]) -> tuple[list[str], list[list[str]]]:
    """Crafted prompts (abnormal, faulted or not), per half: bare and guarded side by side."""
    cr = f["crafted"]
    header = [""] + [f"{split}: {lab}" for split in ("train", "test", "all") for lab in labels]
    rows = [["requests"] + [str(cr[s].get(c, {}).get("requests", 0)) for s in ("train", "test", "all")
                            for c in ("bare", "guarded")]]
    rows += [[name] + [_count(cr[s].get(c, {}), key) for s in ("train", "test", "all") for c in ("bare", "guarded")]
             for name, key in ROWS]
    q = f["quality"]
    rows.append(["greedy faulted answers token-identical to fp32's continuation of their int4 prefix"]
                + [x for s in ("train", "test", "all") for x in
                   ("", f"{q[s]['identical']} of {q[s]['requests']} ({_pct(q[s]['share'])})")])
    return header, rows


def latency_tables(f: dict[str, Any], labels: dict[str, str]) -> list[Block]:
    lat = f["latency"]
    sides = lat["normal"]
    names = [c for c in ("bare", "bare_aa", "guarded") if c in sides]
    head = ["normal prompts, no fault"] + [labels.get(c, c) for c in names]
    rows = [[k, *[_f(sides[c][key]) for c in names]] for k, key in
            (("requests", "requests"), ("failed (counted as the slowest latency)", "failed"),
             ("P50 (ms)", "p50_ms"), ("P90 (ms)", "p90_ms"), ("P99 (ms)", "p99_ms"),
             ("time to first text P50 (ms)", "ttft_p50_ms"), ("time to first text P99 (ms)", "ttft_p99_ms"))]
    rows[0][1:] = [str(sides[c]["requests"]) for c in names]
    rows[1][1:] = [str(sides[c]["failed"]) for c in names]
    out: list[Block] = [("table", (head, rows))]
    ratios = lat["ratios"]
    keys = [k for k in ("guarded_over_bare", "aa_over_bare") if k in ratios]
    head = ["ratio"] + ["guarded / bare" if k == "guarded_over_bare" else "A/A: bare_aa / bare" for k in keys]
    rrows = [[name, *[(_r(ratios[k][key]) if key != "prompts_over_1_05" and key != "prompts"
                       and key != "requests_per_side" else str(ratios[k][key])) for k in keys]]
             for name, key in (("prompts", "prompts"), ("per-prompt median ratio, P50 over prompts", "per_prompt_p50"),
                               ("per-prompt median ratio, P90 over prompts", "per_prompt_p90"),
                               ("per-prompt median ratio, P99 over prompts", "per_prompt_p99"),
                               ("per-prompt median ratio, max", "per_prompt_max"),
                               ("prompts with a median ratio over 1.05", "prompts_over_1_05"),
                               ("pooled P50", "pooled_p50"), ("pooled P99", "pooled_p99"),
                               ("requests per side (pooled)", "requests_per_side"),
                               ("median of ratios paired by (prompt, round)", "paired_median"))]

    def mean_ratio(d: dict[str, Any]) -> str:
        m = d.get("mean_ratio") or {}
        lo, hi = m.get("low"), m.get("high")
        return _r(m.get("value")) + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "")

    rrows.insert(1, ["mean of the prompts' medians, paired [95% bootstrap interval] (the verdict's)",
                     *[mean_ratio(ratios[k]) for k in keys]])
    out.append(("table", (head, rrows)))
    rounds = sorted({r for k in keys for r in ratios[k]["rounds"]}, key=int)
    head = ["round", *[f"{h} {q}" for h in ("guarded / bare", "A/A") for q in ("P50", "P99")][:2 * len(keys)]]
    out.append(("table", (head, [[r, *[_r(ratios[k]["rounds"].get(r, {}).get(q)) for k in keys for q in ("p50", "p99")]]
                                 for r in rounds])))
    return out


def summary_table(f: dict[str, Any], r: dict[str, Any], labels: tuple[str, str]) -> tuple[list[str], list[list[str]]]:
    mem = r.get("memory_mb") or {}
    fh, ho, rs = f["false_handoffs"], f["handoff"], f["rung_share"]
    b, g = f["normal"].get("bare", {}), f["normal"].get("guarded", {})
    rows = [["memory (MB)", _f(mem.get("bare"), "{:.0f}"), _f(mem.get("guarded"), "{:.0f}")],
            ["handoff latency mean / P99 (ms)", "n/a",
             f"{_f(ho.get('guarded', {}).get('mean_ms'))} / {_f(ho.get('guarded', {}).get('p99_ms'))}"],
            ["tokens per rung (all requests)", _shares(rs.get("bare", {})), _shares(rs.get("guarded", {}))],
            ["false handoffs, normal test-half prompts without a fault", "n/a",
             f"{fh.get('guarded', {}).get('handed_off')} of {fh.get('guarded', {}).get('requests')} "
             f"({_pct(fh.get('guarded', {}).get('rate'))})"],
            ["garbage on normal prompts", _count(b, "garbage"), _count(g, "garbage")],
            ["normal answers identical to fp32's greedy answer (reference prompts)",
             *[f"{x.get('identical')} of {x.get('computed')} ({_pct(x.get('share'))})"
               for x in (f["fp32_identical_normal"].get("bare", {}), f["fp32_identical_normal"].get("guarded", {}))]],
            ["ended on a confirmed loop (finish: repetition), crafted; of which stopped",
             *[f"{e.get('requests')}; {e.get('stopped')}" for e in
               (f["ended_on_repetition"].get("bare", {}), f["ended_on_repetition"].get("guarded", {}))]]]
    return ["", *labels], rows


def _measured(v: dict[str, Any]) -> str:
    shown = _f(v["value"], "{:.4g}") if isinstance(v["value"], float) else _f(v["value"])
    iv = v.get("interval")
    if iv and iv[0] is not None and iv[1] is not None:
        shown += f" [{iv[0]:.4g}, {iv[1]:.4g}]"
    return shown


def verdict_table(f: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = [[v["name"], _measured(v), _f(v["limit"], "{:g}"), v["status"].upper(), v["note"]] for v in f["verdicts"]]
    return ["target (fixed before the run, qladder.validate.recompute.TARGETS)", "measured [95% interval]", "limit",
            "", "note"], rows


def fault_table(f: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = []
    bf, gf = f["by_fault"].get("bare", {}), f["by_fault"].get("guarded", {})
    for k in sorted(set(bf) | set(gf), key=lambda k: (str((bf.get(k) or gf.get(k) or {}).get("fault_set")), k)):
        b, g = bf.get(k, {}), gf.get(k, {})
        rows.append([k, str(b.get("fault_set") or g.get("fault_set") or "-"), str(b.get("requests", 0)),
                     _pct(b.get("answered_clean_rate")), _pct(b.get("garbage_rate")), _pct(b.get("five_xx_rate")),
                     _pct(g.get("answered_clean_rate")), _pct(g.get("garbage_rate")), _pct(g.get("garbage_net_rate")),
                     _pct(g.get("fallback_rate")), _pct(g.get("five_xx_rate")),
                     f"{_f(b.get('max_latency_ms'))} / {_f(g.get('max_latency_ms'))}",
                     ", ".join(sorted(set(b.get("reasons", {})) | set(g.get("reasons", {})))) or "-"])
    return ["fault model", "set", "requests", "bare clean", "bare garbage", "bare 5xx", "guarded clean",
            "guarded garbage", "guarded garbage net", "guarded fallback", "guarded 5xx",
            "slowest bare / guarded (ms)", "symptoms seen"], rows


def class_table(f: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    bc, gc = f["by_class"].get("bare", {}), f["by_class"].get("guarded", {})
    rows = [[c, str(bc.get(c, {}).get("requests", 0)), _pct(bc.get(c, {}).get("answered_clean_rate")),
             _pct(gc.get(c, {}).get("answered_clean_rate")), _pct(gc.get(c, {}).get("garbage_net_rate"))]
            for c in sorted(set(bc) | set(gc))]
    return ["prompt class", "requests", "bare answered clean", "guarded answered clean", "guarded garbage net"], rows


def judge_text(f: dict[str, Any]) -> str:
    j = f["judge"]
    cal = j.get("calibration") or {}
    return (f"Garbage = any symptom judged from the ids and the text (NaN words, U+FFFD or control runs not in the "
            f"sanitized prompt, black squares, floods of one token or character of 6 or more, token-0 floods, "
            f"empty answers) or `implausible`: fp32, reading the answer after the same prompt ids, gives it a "
            f"mean NLL over {j['threshold_nll']:.3f} nats/token, the calibrated threshold (quantile "
            f"{cal.get('quantile')} of {cal.get('answers')} train-half normal answers' scores, "
            f"{_f(cal.get('quantile_nll'), '{:.3f}')}, plus {cal.get('margin')}; from {cal.get('source')}). "
            f"Normal test-half answers over it: {j.get('normal_test_over_threshold')} of "
            f"{j.get('normal_test_answers')} (largest {_f(j.get('normal_test_max_nll'), '{:.3f}')}). "
            f"Stopped (the guard ended the answer short of fp32's): {j.get('stopped')}, counted against the "
            f"configuration beside garbage. {j['scored']} of "
            f"{j['answers']} answers scored; {j['unjudged']} unjudged (scoring failed, no symptom): "
            f"{_pct(j['unjudged_share'])}. Clean answers (no fault) reach at most {_f(j['clean_max_nll'], '{:.2f}')} "
            f"(median {_f(j['clean_p50_nll'], '{:.2f}')}), {j['clean_over_threshold']} of {j['clean_scored']} over "
            f"the threshold. Answer ids re-tokenized from text (a server that gave none): "
            f"{j['token_ids_retokenized']}. The fallback is its own column and never counts as clean.")


PRECISION_CLASSES = ("chat", "qa", "code", "math", "abnormal", "known")


def precision_table(f: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The precision boundary (figures' `precision`): per mode and class, answers identical to
    fp32's (k/n), top-1 agreement with fp32 (teacher-forced), the median first divergence; the
    known-answer questions right; tok/s."""
    head = ["mode", "tok/s", *PRECISION_CLASSES, "known answers right"]
    rows = []
    for mode, m in f.get("precision", {}).items():
        cells = []
        for cls in PRECISION_CLASSES:
            c = m["classes"].get(cls)
            if c is None:
                cells.append("-")
            elif c.get("reference"):
                cells.append(f"the reference ({c['answers']})")
            elif not c.get("compared"):
                cells.append(f"no reference ids kept ({c['answers']})")
            else:
                cells.append(f"{c['identical_to_fp32']}/{c['compared']}, top-1 {_f(c['top1_agreement'], '{:.2f}')}, "
                             f"div@{_f(c['first_divergence_median'], '{:.0f}')}")
        k = m["classes"].get("known", {})
        right = f"{k['known_right']}/{k['known_asked']}" if k.get("known_asked") else "-"
        rows.append([mode, _f(m["tok_s"]), *cells, right])
    return head, rows


def common_blocks(r: dict[str, Any], images: dict[str, str | None], labels: tuple[str, str],
                  side_labels: dict[str, str]) -> list[Block]:
    f = r["figures"]
    out: list[Block] = [
        ("h2", f"Verdict: {f['verdict'].upper()}"), ("table", verdict_table(f)),
        *([("h2", "Precision boundary: answers against full precision's, no fault"),
           ("p", "The same prompt ids through each mode, greedy, one at a time: answers identical to fp32's "
                 "greedy answer (k/n), top-1 agreement with fp32 on the answer's own context, the median first "
                 "divergence (div@: among answers that differ), known-answer questions right, tok/s. For reading: "
                 "no verdict rests on it."),
           ("table", precision_table(f))] if f.get("precision") else []),
        ("h2", "Crafted prompts (abnormal, with and without a fault), per half"),
        ("p", "train: the fault models and prompts the guard's bounds and the calibration scripts were tuned on "
              "(in-sample); test: held-out fault models (other tensors, rows, factors, glitch tokens, steps) on the "
              "other half of the prompts. `answered clean` = an answer that is neither garbage, nor the fallback, "
              "nor unjudged; 5xx and 4xx are neither."),
        ("table", split_table(f, labels)), ("table", summary_table(f, r, labels)),
        ("h2", "Latency, normal prompts"),
        ("p", "Each prompt's median over the rounds, guarded over bare, read at P90 and P99 over prompts, and "
              "the pooled P99 over every request; the A/A pair (two identical bare engines) is the noise "
              "floor. A request with no answer counts as the run's slowest latency."),
        *latency_tables(f, side_labels),
    ]
    if images.get("latency_cdf"):
        out.append(("img", (images["latency_cdf"], "latency CDF")))
    out += [("h2", "Per fault model (crafted prompts)")]
    if images.get("replay"):
        out.append(("img", (images["replay"], "answers per fault model")))
    out += [("table", fault_table(f)), ("p", judge_text(f)),
            ("h2", "Per prompt class (crafted)"), ("table", class_table(f))]
    return out


def precision_blocks(r: dict[str, Any], img: str | None) -> list[Block]:
    pb = r.get("precision_boundary") or {}
    rows = [[rung, _f(v["first_nonfinite_x"], "{:g}"), _f(v["first_divergence_x"], "{:g}"),
             _f(v["first_detection_x"], "{:g}")] for rung, v in (pb.get("boundary") or {}).items()]
    out: list[Block] = [("h2", "Precision boundary"),
                        ("p", "A gain x on layer 11, channel 507 (SmolLM2's massive activation, ~24,900 in fp32) "
                              "on each rung; greedy decoding on short prompts. 'Diverges' compares with fp32 "
                              "under the same gain: the rung's precision, not the fault, changed the answer. "
                              "On int4 the gain is a llama.cpp control vector that adds (x-1) x 24,900 at every "
                              "position, a harsher fault than the torch rungs' multiplicative one. In the map, "
                              "'NaN' is the share of prompts with a non-finite row, 'div' the share whose answer "
                              "differs from fp32 under the same gain, 'guard' the share where the default step "
                              "guard (logits + activation limit at 60% of fp16) fired on that rung.")]
    if img:
        out.append(("img", (img, "precision boundary")))
    out.append(("table", (["rung", "first x with NaN/Inf", "first x diverging from fp32", "first x the guard fires"],
                          rows)))
    summary = [[s["rung"], _f(s["x"], "{:g}"), _pct(s["nonfinite_rate"]), _pct(s["diverged_fault_rate"]),
                _pct(s["detection_rate"]), _pct(s["broken_caught_rate"]), _f(s["peak_max"], "{:,.0f}")]
               for s in pb.get("summary") or []]
    out.append(("table", (["rung", "x", "non-finite", "diverged (same fault)", "guard fired",
                           "broken & caught in time", "peak |hidden|"], summary)))
    return out


def latency_blocks(r: dict[str, Any], img: str | None) -> list[Block]:
    lb = r.get("latency_boundary") or {}
    rows = [[n, _f(v["p50_ms"]), _f(v["p99_ms"]), _f(v["step_p50_ms"], "{:.2f}"),
             _f(v["step_p50_ratio"], "{:.3f}"), _f(v["step_p99_ratio"], "{:.3f}"),
             _f(v["paired_median_ratio"], "{:.3f}"), _f(v["p99_ratio"], "{:.3f}")]
            for n, v in (lb.get("levels") or {}).items()]
    mon = lb.get("fp32_activation_monitors") or {}
    out: list[Block] = [("h2", "Latency boundary"),
                        ("p", f"The same {lb.get('prompts')} normal prompts through the naive greedy loop (bare) and "
                              f"the ladder at each check level, {lb.get('rounds')} interleaved rounds with a rotating "
                              f"order, exactly {lb.get('max_tokens')} tokens each; ratios against bare. 'bare (A/A "
                              "control)' is bare again: its distance from 1.000 is the noise floor of this run. "
                              "Step figures are decode-step intervals (prefill excluded). 'default (+activations)' "
                              "adds the int4 activation monitor (llama.cpp cb_eval, in C) to 'logits+repetition'; "
                              "the fp32 rung's per-layer monitor hooks cost "
                              f"x{_f(mon.get('ratio'), '{:.3f}')} per token (measured separately). The warm shadow "
                              "prefills fp32 on the other core while int4 decodes.")]
    if img:
        out.append(("img", (img, "latency per check level")))
    out.append(("table", (["level", "P50 ms", "P99 ms", "step P50 ms", "step P50 ratio", "step P99 ratio",
                           "paired median ratio", "P99 ratio"], rows)))
    return out


def availability_blocks(r: dict[str, Any], img: str | None) -> list[Block]:
    av = r.get("availability_boundary") or {}
    if "model" not in av:
        return [("h2", "Availability boundary"), ("p", av.get("error", "not measured"))]
    m = av["model"]
    text = (f"{m['servers']} single-core workers, {m['c_standby']} of them ({m['standby_share']:.0%}) the fp32 "
            f"standby; the int4 pool at {m['primary_util']:.0%} utilization serves {m['arrival_rate_rps']:.2f} req/s "
            f"(measured {m['s_primary_ms']:.0f} ms per request). Each handoff costs the standby "
            f"{m['s_standby_ms']:.0f} ms (handoff latency + the fp32 tail). The standby saturates when "
            f"**{100 * m['saturation_share']:.1f}%** of requests hand off ({m['saturation_handoffs_per_s']:.2f} "
            f"handoffs/s); its mean queueing wait reaches one handoff latency "
            f"({_f(av.get('wait_budget_ms'))} ms) at {_pct(av.get('share_at_wait_budget'))}.")
    out: list[Block] = [("h2", "Availability boundary"), ("p", text)]
    if img:
        out.append(("img", (img, "availability boundary")))
    rows = [[_pct(s["share"]), _f(s["model_wait_ms"]), _f(s["simulated_wait_ms"])] for s in av.get("simulation", [])]
    out.append(("table", (["handoff share", "M/M/c mean wait (ms)", "simulated M/G/c wait (ms)"], rows)))
    out.append(("p", av.get("note", "")))
    rep = av.get("concurrent_replay") or {}
    if rep.get("points"):
        out.append(("p", f"**Concurrent replay.** Measured handoffs replayed for real on {rep['servers']} fp32 "
                         f"standby worker(s), Poisson arrivals at two loads; the model is confirmed at a point "
                         f"when the measured mean wait falls inside its 95% band. {rep.get('note', '')}"))
        rows = [[f"{p['target_utilization']:.0%} ({p['measured_utilization']:.0%})", str(p["jobs"]),
                 _f(p["service_mean_ms"]), _f(p["wait_mean_ms"]), _f(p["ideal_queue_wait_mean_ms"]),
                 f"{_f(p['model_wait_mean_ms'])} [{_f(p['model_band_95_ms'][0])}, {_f(p['model_band_95_ms'][1])}]",
                 "yes" if p["confirmed"] else "NO"] for p in rep["points"]]
        out.append(("table", (["standby load target (measured)", "jobs", "service mean (ms)",
                               "measured mean wait (ms)", "ideal FCFS queue, same jobs (ms)",
                               "M/G/c model [95% band] (ms)", "confirmed"], rows)))
    elif rep.get("error"):
        out.append(("p", f"Concurrent replay: {rep['error']}"))
    return out


def to_markdown(bl: list[Block]) -> str:
    lines: list[str] = []
    for kind, body in bl:
        if kind in ("h1", "h2"):
            lines += [("# " if kind == "h1" else "## ") + body, ""]
        elif kind == "p":
            lines += [body, ""]
        elif kind == "img":
            lines += [f"![{body[1]}]({body[0]})", ""]
        else:
            header, rows = body
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|" + "---|" * len(header))
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
            lines.append("")
    return "\n".join(lines)


CSS = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;"
       "text-align:left}th{background:#f2f4f4}img{max-width:100%;border:1px solid #eee}")


def to_html(bl: list[Block], out_dir: Path) -> str:
    parts = ["<!doctype html><meta charset='utf-8'><title>qladder validate</title>", f"<style>{CSS}</style>"]
    for kind, body in bl:
        if kind in ("h1", "h2"):
            parts.append(f"<{kind}>{html.escape(body)}</{kind}>")
        elif kind == "p":
            text = html.escape(body)
            while "**" in text:
                text = text.replace("**", "<b>", 1).replace("**", "</b>", 1)
            parts.append(f"<p>{text}</p>")
        elif kind == "img":
            data = base64.b64encode((out_dir / body[0]).read_bytes()).decode("ascii")
            parts.append(f"<p><img alt='{html.escape(body[1])}' src='data:image/png;base64,{data}'></p>")
        else:
            header, rows = body
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
            parts.append(f"<table><tr>{head}</tr>{trs}</table>")
    return "\n".join(parts)


def method_blocks(r: dict[str, Any]) -> list[Block]:
    env, meth, cfg = r["environment"], r["method"], r["config"]
    v = env["versions"]
    rows = [["versions", ", ".join(f"{k} {val}" for k, val in v.items() if val)],
            ["CPU", f"{env['cpu'].get('model')} ({env['cpu'].get('usable_cpus')} usable of "
                    f"{env['cpu'].get('logical_cpus')}, via {env['cpu'].get('source')})"],
            ["threads", f"engine {env['engine_threads']}, torch {env['torch_threads']}"],
            ["int4 activation monitor", str(env.get("int4_activation_monitor"))],
            ["load average start / end", f"{env['load_average_start']} / {env.get('load_average_end')}"],
            ["context", str(env["n_ctx"])],
            ["warm-up", f"{meth['warmup_requests_per_config']} requests per configuration (written, not counted)"],
            ["windows", f"{meth['rounds_normal']} rounds of {meth['prompts']['normal']} normal prompts; "
                        f"{meth['prompts']['abnormal']} abnormal prompts; max_tokens {cfg['max_tokens']}"],
            ["order", meth["order"]], ["engines", meth["engines"]],
            ["seeds", ", ".join(f"{k}={val}" for k, val in meth["seeds"].items())],
            ["garbage collector", meth.get("gc", "on throughout")],
            ["incidents recorded", f"{r['incidents_recorded']} (incidents.sqlite3)"],
            ["peak RSS of the run", f"{env['peak_rss_mb_process']:.0f} MB"],
            ["elapsed", f"{r.get('elapsed_s', 0):.0f} s"]]
    return [("h2", "Method and environment"), ("table", (["", ""], rows)), ("p", meth["memory_note"]),
            *fault_model_blocks(r)]


def fault_model_blocks(r: dict[str, Any]) -> list[Block]:
    faults = [[fm["name"], fm["fault_set"], ", ".join(fm["specs"]) or str(fm.get("applied_patch") or fm["gguf_patch"]),
               fm["phenomenon"]] for fm in r["fault_models"]]
    return [("h2", "Fault models"), ("table", (["model", "set", "spec / patch", "emulates"], faults))]


def recompute_text(r: dict[str, Any]) -> str:
    return ("Every figure below is computed from outcomes.jsonl (one line per request, warm-up included) by "
            "`qladder.validate.recompute`; `python -m qladder.validate.recompute DIR` reproduces results.json's "
            "figures from it and exits 1 on any difference (`--check`: also on a missed target).")


IN_PROCESS_LABELS = ("bare int4", "guarded ladder")
SIDE_LABELS = {"bare": "bare int4", "bare_aa": "bare int4 (A/A copy)", "guarded": "guarded ladder"}


def blocks(r: dict[str, Any], bounds: dict[str, Any], images: dict[str, str | None]) -> list[Block]:
    mode = "quick" if r["config"]["quick"] else "full"
    m = r["method"]
    out: list[Block] = [
        ("h1", "qladder validate: bare INT4 vs the guarded ladder"),
        ("p", f"Run mode **{mode}**, {m['prompts']['normal']} normal prompts x {m['rounds_normal']} rounds and "
              f"{m['prompts']['abnormal']} abnormal prompts ({m['prompts']['abnormal_by_split']}), each "
              f"configuration on a serving engine of its own, one request at a time. {recompute_text(r)}"),
        *common_blocks(r, images, IN_PROCESS_LABELS, SIDE_LABELS),
    ]
    legacy = {"precision_boundary": bounds.get("precision"), "latency_boundary": bounds.get("latency"),
              "availability_boundary": bounds.get("availability")}
    out += [("p", "The boundaries below are separate instruments (boundaries.json), not requests of the replay.")]
    out += precision_blocks(legacy, images.get("precision"))
    out += latency_blocks(legacy, images.get("latency_levels"))
    out += availability_blocks(legacy, images.get("availability"))
    return out + method_blocks(r)


def _latency_samples(out_dir: Path) -> dict[str, list[float]]:
    path = out_dir / "outcomes.jsonl"
    if not path.is_file():
        return {}
    walls: dict[str, list[float]] = {}
    for o in read_jsonl(path):
        if o.phase == "normal" and o.ok:
            walls.setdefault(o.config, []).append(o.latency_ms)
    return walls


def _draw(r: dict[str, Any], out_dir: Path, extra: dict[str, Any]) -> dict[str, str | None]:
    images: dict[str, str | None] = {}
    if not plots.available():
        return images
    walls = _latency_samples(out_dir)
    draws: dict[str, Callable[[Path], Path | None]] = {
        "replay": lambda p: plots.replay(r["figures"], p), "latency_cdf": lambda p: plots.latency_cdf(walls, p)}
    draws |= extra
    for name, draw in draws.items():
        path = draw(out_dir / f"{name}.png")
        images[name] = path.name if path else None
    return images


def _write(bl: list[Block], out_dir: Path) -> None:
    if not plots.available():
        bl.insert(1, ("p", "matplotlib is not installed: plots were skipped (pip install matplotlib)."))
    (out_dir / "report.md").write_text(to_markdown(bl), encoding="utf-8")
    (out_dir / "report.html").write_text(to_html(bl, out_dir), encoding="utf-8")


def write_report(r: dict[str, Any], bounds: dict[str, Any], out_dir: Path) -> dict[str, str | None]:
    legacy = {"precision_boundary": bounds.get("precision"), "latency_boundary": bounds.get("latency"),
              "availability_boundary": bounds.get("availability")}
    images = _draw(r, out_dir, {"precision": lambda p: plots.precision(legacy, p),
                                "latency_levels": lambda p: plots.latency_levels(legacy, p),
                                "availability": lambda p: plots.availability(legacy, p)})
    _write(blocks(r, bounds, images), out_dir)
    return images


# -- qladder validate --remote ---------------------------------------------------------------------------

REMOTE_LABELS = ("bare llama-server", "qladder serve")
REMOTE_SIDE_LABELS = {"bare": "bare llama-server", "bare_aa": "bare llama-server (A/A: a second process)",
                      "guarded": "qladder serve (llama-server + vLLM)"}


def server_table(r: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    s = r["environment"]["servers"]
    ls, vl = s["llama_server"], s["vllm"]
    mem = r["environment"]["memory_rss_mb"]
    rows = [["llama-server", str(ls.get("version")), " ".join(ls.get("args", [])[2:]), str(ls.get("threads"))],
            ["vLLM", str(vl.get("version")), " ".join(vl.get("args", [])) or str(vl.get("url")),
             str(vl.get("OMP_NUM_THREADS", "n/a"))],
            ["qladder serve", str(r["environment"]["versions"].get("qladder")),
             f"{s['qladder_serve']['processes']} processes (one per served model)", "-"],
            ["clients", str(s["concurrency"]["clients"]), s["concurrency"]["mode"], "-"]]
    rows += [[f"memory: {k}", _f(v, "{:.0f}") + " MB", "", ""] for k, v in mem.items()]
    return ["", "version", "flags", "threads"], rows


def remote_blocks(r: dict[str, Any], images: dict[str, str | None]) -> list[Block]:
    mode = "quick" if r["config"]["quick"] else "full"
    m = r["method"]
    out: list[Block] = [
        ("h1", "qladder validate --remote: bare llama-server vs qladder serve over llama-server + vLLM"),
        ("p", f"Run mode **{mode}**, {m['prompts']['normal']} normal prompts x {m['rounds_normal']} rounds and "
              f"{m['prompts']['abnormal']} abnormal prompts, {m['clients']} clients in parallel. {m['order']}. "
              f"{m['faults_note']}. {recompute_text(r)}"),
        *common_blocks(r, images, REMOTE_LABELS, REMOTE_SIDE_LABELS),
        ("h2", "Servers"), ("table", server_table(r)),
        ("p", f"Incidents recorded by each qladder serve: {r.get('incidents_recorded')}. Draft checks by each "
              f"(a flagged input's draft, vLLM scored: passed, refused, unchecked; too long to score: skipped): "
              f"{r.get('draft_checks')}. {m['memory_note']}."),
    ]
    return out + fault_model_blocks(r)


def write_remote_report(r: dict[str, Any], out_dir: Path) -> None:
    _write(remote_blocks(r, _draw(r, out_dir, {})), out_dir)
