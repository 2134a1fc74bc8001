"""report.md and report.html from results.json: the side-by-side table, the three boundaries, the
method. Both are built from one list of blocks (heading, text, table, image); the HTML embeds the
PNGs as base64 so the single file can be mailed or opened anywhere, the PNGs are also kept beside it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from qladder.validate import plots

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


def _pair(lat: dict[str, Any]) -> str:
    return f"{_f(lat['per_token_p50_ms'], '{:.2f}')} / {_f(lat['per_token_p99_ms'], '{:.2f}')}"


def main_table(r: dict[str, Any], labels: tuple[str, str] = ("bare int4", "guarded ladder")
               ) -> tuple[list[str], list[list[str]]]:
    b, g, ratio = r["bare"], r["guarded"], r["latency_ratio_guarded_over_bare"]
    lb, lg = b["latency_normal"], g["latency_normal"]
    rows = [
        ["P50 latency, normal prompts (ms)", _f(lb["p50_ms"]), _f(lg["p50_ms"]), _f(ratio["p50"], "{:.3f}")],
        ["P99 latency, normal prompts (ms)", _f(lb["p99_ms"]), _f(lg["p99_ms"]), _f(ratio["p99"], "{:.3f}")],
        ["P99 over prompts of each prompt's median latency (ms)", _f(ratio.get("bare_p99_prompt_medians_ms")),
         _f(ratio.get("guarded_p99_prompt_medians_ms")), _f(ratio.get("p99_prompt_medians"), "{:.3f}")],
        ["paired median latency ratio", "", "", _f(ratio["paired_median"], "{:.3f}")],
        ["per-token decode P50 / P99 (ms)", _pair(lb), _pair(lg), _f(ratio["per_token_p50"], "{:.3f}")],
        ["memory (process RSS, MB)", _f(b["memory_rss_mb"], "{:.0f}"), _f(g["memory_rss_mb"], "{:.0f}"), ""],
        ["garbage output, crafted prompts", _pct(b["garbage_rate"]), _pct(g["garbage_rate"]), ""],
        ["... of which fp32 alone answers the same garbage (the model's own)", "",
         str(g.get("garbage_model_own", 0)), ""],
        ["5xx, crafted prompts", _pct(b["error_rate"]), _pct(g["error_rate"]), ""],
        ["4xx (refused), crafted prompts", _pct(b["reject_rate"]), _pct(g["reject_rate"]), ""],
        ["safe fallback answers", str(b["fallback"]), str(g["fallback"]), ""],
        ["ended on a confirmed loop (finish: repetition), crafted prompts",
         _ended(b.get("ended_on_repetition")), _ended(g.get("ended_on_repetition")), ""],
        ["handoff latency mean / P99 (ms)", "n/a",
         f"{_f(g['handoff']['mean_ms'])} / {_f(g['handoff']['p99_ms'])}", ""],
        ["tokens per rung (all requests)", _shares(b["rung_share_all"]), _shares(g["rung_share_all"]), ""],
        ["false handoffs, clean traffic", "n/a", _pct(g["false_handoff_rate"]), ""],
        ["greedy agreement with fp32 (prefix / position)",
         f"{_pct(b['agreement_fp32'].get('prefix'))} / {_pct(b['agreement_fp32'].get('position'))}",
         f"{_pct(g['agreement_fp32'].get('prefix'))} / {_pct(g['agreement_fp32'].get('position'))}", ""],
    ]
    return ["", *labels, "guarded / bare"], rows


def verdicts(r: dict[str, Any]) -> list[list[str]]:
    g, ratio = r["guarded"], r["latency_ratio_guarded_over_bare"]
    checks = [("guarded garbage on crafted prompts, beyond what fp32 alone answers, = 0%",
               g.get("garbage_beyond_fp32_rate", g["garbage_rate"]), lambda v: v == 0, _pct),
              ("guarded 5xx on crafted prompts = 0%", g["error_rate"], lambda v: v == 0, _pct),
              ("false handoff rate <= 0.5%", g["false_handoff_rate"], lambda v: v <= 0.005, _pct),
              ("P99 guarded / bare <= 1.01 (P99 over prompts of each prompt's median of the interleaved "
               "rounds)", ratio.get("p99_prompt_medians"), lambda v: v <= 1.01, lambda v: _f(v, "{:.3f}"))]
    rows = [[name, fmt(v), "n/a" if v is None else ("PASS" if ok(v) else "FAIL")] for name, v, ok, fmt in checks]
    rows.append(["P99 guarded / bare over every request, rounds pooled (machine noise included)",
                 _f(ratio["p99"], "{:.3f}"), "for reading the line above"])
    aa = ((r.get("latency_boundary") or {}).get("levels") or {}).get("bare (A/A control)")
    if aa:
        rows.append(["noise floor: P99 ratio of two identical configurations (A/A)",
                     _f(aa.get("p99_ratio"), "{:.3f}"), "for reading the line above"])
    return rows


def fault_table(r: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for f, b in r["bare"]["by_fault"].items():
        g = r["guarded"]["by_fault"].get(f, {})
        rows.append([f, str(b["requests"]), _pct(b["garbage_rate"]), _pct(b["error_rate"]),
                     _pct(g.get("garbage_rate")), _pct(g.get("error_rate")),
                     f"{_f(b.get('max_wall_ms'))} / {_f(g.get('max_wall_ms'))}",
                     ", ".join(sorted(set(b["garbage_reasons"]) | set(g.get("garbage_reasons", {})))) or "-"])
    return ["fault model", "requests", "bare garbage", "bare 5xx", "guarded garbage", "guarded 5xx",
            "slowest request bare / guarded (ms)", "symptoms seen"], rows


def class_table(r: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for c, b in r["bare"]["by_class"].items():
        g = r["guarded"]["by_class"].get(c, {})
        rows.append([c, str(b["requests"]), _pct(b["failure_rate"]), _pct(g.get("failure_rate"))])
    return ["prompt class", "requests", "bare failures (garbage+5xx+4xx)", "guarded failures"], rows


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
            ["warm-up", f"{meth['warmup_requests_per_config']} requests per configuration"],
            ["windows", f"{meth['rounds_normal']} rounds of {meth['prompts']['normal']} normal prompts; "
                        f"{meth['prompts']['abnormal']} abnormal prompts; max_tokens {cfg['max_tokens']}"],
            ["seeds", ", ".join(f"{k}={val}" for k, val in meth["seeds"].items())],
            ["garbage collector", meth.get("gc", "on throughout")],
            ["failure paths seen", ", ".join(r["failure_paths_seen"])],
            ["incidents recorded", f"{r['incidents_recorded']} (incidents.sqlite3)"],
            ["peak RSS of the run", f"{env['peak_rss_mb_process']:.0f} MB"],
            ["elapsed", f"{r.get('elapsed_s', 0):.0f} s"]]
    faults = [[fm["name"], ", ".join(fm["specs"]), fm["phenomenon"]] for fm in r["fault_models"]]
    return [("h2", "Method and environment"), ("table", (["", ""], rows)), ("p", meth["memory_note"]),
            ("h2", "Fault models"), ("table", (["model", "spec", "emulates"], faults))]


def blocks(r: dict[str, Any], images: dict[str, str | None]) -> list[Block]:
    mode = "quick" if r["config"]["quick"] else "full"
    out: list[Block] = [
        ("h1", "qladder validate: bare INT4 vs the guarded ladder"),
        ("p", f"Run mode **{mode}**, {r['method']['prompts']['normal']} normal and "
              f"{r['method']['prompts']['abnormal']} abnormal prompts, both configurations on the same prompts "
              f"and faults in one process. Crafted = abnormal prompts with and without a fault model."),
        ("table", main_table(r)),
        ("h2", "Targets"), ("table", (["target", "measured", ""], verdicts(r))),
    ]
    if images.get("latency_cdf"):
        out.append(("img", (images["latency_cdf"], "latency CDF")))
    out += [("h2", "Per fault model (abnormal prompts)")]
    if images.get("replay"):
        out.append(("img", (images["replay"], "garbage and 5xx per fault model")))
    out += [("table", fault_table(r))]
    j = r.get("garbage_judge") or {}
    if j.get("scored"):
        out.append(("p", "Garbage = any symptom of the incident (NaN text, U+FFFD, black squares, loops, "
                         "token-0 floods, empty) or `implausible`: the fp32 rung, reading the answer after "
                         f"the same prompt, gives it a mean NLL over {j['threshold_nll']:g} nats/token. "
                         f"{j['scored']} abnormal answers scored; clean ones (no fault) reach at most "
                         f"{_f(j.get('clean_max_nll'), '{:.2f}')} (median {_f(j.get('clean_p50_nll'), '{:.2f}')}), "
                         f"{j.get('clean_flagged', 0)} of {j.get('clean_scored', 0)} over the threshold."))
    out += [("h2", "Per prompt class (crafted)"), ("table", class_table(r))]
    out += precision_blocks(r, images.get("precision"))
    out += latency_blocks(r, images.get("latency_levels"))
    out += availability_blocks(r, images.get("availability"))
    return out + method_blocks(r)


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


def write_report(r: dict[str, Any], out_dir: Path) -> dict[str, str | None]:
    images: dict[str, str | None] = {}
    if plots.available():
        walls = r.get("latency_samples_normal_ms") or {}
        for name, draw in (("replay", lambda p: plots.replay(r, p)),
                           ("latency_cdf", lambda p: plots.latency_cdf(walls, p)),
                           ("precision", lambda p: plots.precision(r, p)),
                           ("latency_levels", lambda p: plots.latency_levels(r, p)),
                           ("availability", lambda p: plots.availability(r, p))):
            path = draw(out_dir / f"{name}.png")
            images[name] = path.name if path else None
    bl = blocks(r, images)
    if not plots.available():
        bl.insert(1, ("p", "matplotlib is not installed: plots were skipped (pip install matplotlib)."))
    (out_dir / "report.md").write_text(to_markdown(bl), encoding="utf-8")
    (out_dir / "report.html").write_text(to_html(bl, out_dir), encoding="utf-8")
    return images


def _ended(e: dict[str, Any] | None) -> str:
    if not e:
        return "n/a"
    return f"{e['requests']} ({_pct(e['rate'])}; judged garbage: {e['judged_garbage']})"


# -- qladder validate --remote ---------------------------------------------------------------------------

REMOTE_LABELS = ("bare llama-server", "qladder serve (llama-server + vLLM)")


def remote_verdicts(r: dict[str, Any]) -> list[list[str]]:
    g = r["guarded"]
    checks = [("guarded garbage on crafted prompts, beyond what fp32 alone answers, = 0%",
               g.get("garbage_beyond_fp32_rate"), lambda v: v == 0, _pct),
              ("guarded 5xx on crafted prompts = 0%", g["error_rate"], lambda v: v == 0, _pct),
              ("P99 of normal requests, gateway / bare llama-server <= 1.05 (every request, rounds pooled)",
               r.get("p99_ratio_gateway_over_bare"), lambda v: v <= 1.05, lambda v: _f(v, "{:.3f}"))]
    rows = [[name, fmt(v), "n/a" if v is None else ("PASS" if ok(v) else "FAIL")] for name, v, ok, fmt in checks]
    ratio = r["latency_ratio_guarded_over_bare"]
    rows.append(["P99 over prompts of each prompt's median (machine noise damped)",
                 _f(ratio.get("p99_prompt_medians"), "{:.3f}"), "for reading the line above"])
    return rows


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


def beside_table(b: dict[str, Any], r: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for name, key, fmt in (("garbage, crafted prompts", "garbage_rate", _pct),
                           ("garbage beyond fp32's own", "garbage_beyond_fp32_rate", _pct),
                           ("5xx, crafted prompts", "error_rate", _pct),
                           ("P99 latency, normal prompts (ms)", "p99_ms", _f)):
        def get(sec: dict[str, Any], key: str = key) -> Any:
            return sec.get("latency_normal", {}).get("p99_ms") if key == "p99_ms" else sec.get(key)

        rows.append([name, fmt(b["bare"].get(key)), fmt(b["guarded"].get(key)), fmt(get(r["bare"])),
                     fmt(get(r["guarded"]))])
    return ["", "in-process bare int4", "in-process guarded", "remote bare", "remote guarded"], rows


def remote_blocks(r: dict[str, Any], images: dict[str, str | None]) -> list[Block]:
    mode = "quick" if r["config"]["quick"] else "full"
    m = r["method"]
    head, rows = main_table(r, REMOTE_LABELS)
    t = r.get("ttft_normal_ms") or {}
    if t:
        rows.insert(4, ["time to first text P50 / P99, normal prompts (ms)",
                        f"{_f(t['bare']['p50'])} / {_f(t['bare']['p99'])}",
                        f"{_f(t['guarded']['p50'])} / {_f(t['guarded']['p99'])}",
                        "the gateway holds an answer's first 8 tokens on the INT4 rung (the draft "
                        "check), then 7 behind (the diffuse window)"])
    out: list[Block] = [
        ("h1", "qladder validate --remote: bare llama-server vs qladder serve over llama-server + vLLM"),
        ("p", f"Run mode **{mode}**, {m['prompts']['normal']} normal prompts x {m['rounds_normal']} rounds and "
              f"{m['prompts']['abnormal']} abnormal prompts, {m['clients']} clients in parallel. {m['order']}. "
              f"{m['faults_note']}. Crafted = abnormal prompts with and without a fault model."),
        ("table", (head, rows)),
        ("h2", "Targets"), ("table", (["target", "measured", ""], remote_verdicts(r))),
    ]
    if images.get("latency_cdf"):
        out.append(("img", (images["latency_cdf"], "latency CDF")))
    out += [("h2", "Per fault model (abnormal prompts)")]
    if images.get("replay"):
        out.append(("img", (images["replay"], "garbage and 5xx per fault model")))
    out += [("table", fault_table(r)), ("h2", "Per prompt class (crafted)"), ("table", class_table(r)),
            ("h2", "Servers"), ("table", server_table(r)),
            ("p", f"Incidents recorded by each qladder serve: {r.get('incidents_recorded')}. Draft checks by "
                  f"each (vLLM scored: passed, refused, unchecked; released unscored: confident; not held: "
                  f"skipped): {r.get('draft_checks')}. {m['memory_note']}.")]
    b = r.get("beside_in_process")
    if b:
        out += [("h2", "Beside the in-process run"),
                ("p", f"From {b['path']} ({'quick' if b.get('quick') else 'full'} run)."),
                ("table", beside_table(b, r))]
    return out


def write_remote_report(r: dict[str, Any], out_dir: Path) -> None:
    images: dict[str, str | None] = {}
    if plots.available():
        walls = r.get("latency_samples_normal_ms") or {}
        for name, draw in (("replay", lambda p: plots.replay(r, p)),
                           ("latency_cdf", lambda p: plots.latency_cdf(walls, p))):
            path = draw(out_dir / f"{name}.png")
            images[name] = path.name if path else None
    bl = remote_blocks(r, images)
    (out_dir / "report.md").write_text(to_markdown(bl), encoding="utf-8")
    (out_dir / "report.html").write_text(to_html(bl, out_dir), encoding="utf-8")
