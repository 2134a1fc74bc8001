"""`qladder validate --remote`: the write-up's table on real serving engines, over HTTP.

    bare     clients -> llama-server                                   (a user without qladder)
    bare_aa  clients -> a second llama-server on the same GGUF         (the A/A pair: the noise floor)
    guarded  clients -> qladder serve -> a third llama-server (INT4 pool) -> vLLM (the fp32 standby)

Each configuration of the clean traffic has a llama-server of its own on the embedded GGUF, so no
configuration's prompts warm another's slots (llama-server reuses a slot's KV for a prompt it saw:
when guarded's gateway fronted bare's server, bare's time to first token drew on guarded's
requests, 329 ms against bare_aa's 362 on 2026-12-07, and the A/A pair could not contain 1). One per
GGUF fault model (corrupted scales, inf scales, glitch-token embeddings: the train set, and the
held-out test set on the other half of the prompts) serves that model's prompts, each fronted by
a `qladder serve` process of its own, all sharing one vLLM standby. Per-request faults (nan@step
and the like) are not part of this run: a bare server cannot be made to take them.

Requests stream from `clients` threads at once (production traffic arrives in parallel).
Bare sends the chat template's ids (the GGUF's template rendered by the client: the ids
llama-server's own rendering gives) to llama-server's `/completion` with `return_tokens`, so the
answer's ids are the server's own. Guarded sends the text through the official `openai` client
to `/v1/chat/completions` and asks for the ids in the "qladder" extension. A prompt that is not
valid Unicode (raw bytes, a lone surrogate) cannot travel as text: both send its bytes' tokens
(`tokenize_bytes`) as a token-id prompt, and qladder's input defence reads the ids' bytes.

Normal prompts run `rounds` times, the order of bare, bare_aa and guarded rotated per round;
abnormal prompts (with and without a fault model) run once per configuration. Every answer is
judged by the independent judge (`validate/garbage.py`) with its fp32 likelihood from vLLM
(`prompt_logprobs`); vLLM's own greedy answer to the same ids tells an answer that is fp32's own;
each guarded answer after its llama-server prefix is compared with vLLM's greedy continuation.
outcomes.jsonl holds every request; results.json's figures come from it alone
(`qladder.validate.recompute`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import shutil
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from qladder.errors import ConfigError, InputError
from qladder.server.topology import PRECISIONS
from qladder.validate.corpora import Prompt
from qladder.validate.fault_models import ALL_FAULT_MODELS, FAULT_SETS, FaultModel, assign, by_name
from qladder.validate.outcome import Outcome

RUN = "validate-remote"
REMOTE_FAULTS = tuple(m.name for m in ALL_FAULT_MODELS if m.gguf_patch is not None)  # faults in the served GGUF
EXAMPLE_CONFIG = Path(__file__).with_name("remote_example.toml")
MODEL = "smollm2-135m-instruct"
CONFIGS = ("bare", "bare_aa", "guarded")
_VOCAB_LOCK = threading.Lock()


@dataclass(frozen=True)
class RemoteValidateConfig:
    quick: bool = False
    max_tokens: int = 32
    normal_per_class: int = 18  # x 4 classes x 7 rounds: >= 500 requests per side for the pooled P99
    abnormal_per_class: dict[str, int] | int = 4
    prompts_per_fault: int = 3
    fault_names: tuple[str, ...] = ()  # () = every GGUF fault model of both sets (quick: the quick ones)
    rounds: int = 7
    warmup: int = 4
    reference_prompts: int = 8  # normal prompts whose answers are compared with vLLM's greedy answer
    clients: int = 4  # concurrent client threads (each configuration in turn)
    request_timeout_s: float = 300.0
    llama_slots: int = 4  # llama-server -np
    llama_threads: int = 1  # -t / -tb
    n_ctx_per_slot: int = 2048
    vllm_threads: int = 1
    vllm_max_num_seqs: int = 8
    vllm_kv_cache_gib: int = 1
    vllm_eager: bool = False  # --enforce-eager: starts in ~30 s instead of ~80-100 s, ~10% slower
    vllm_url: str | None = None  # a running vLLM on the same fp32 weights (else started here)
    # the gateway's INT4 pool's decode mode (`qladder serve`'s default unless the config's [gateway] says)
    gateway_precision: str = "fast"
    # the INT4 pool's audit_rate (None: serve's default, the floor behind a vLLM standby; 0: no audit,
    # to measure what the audit costs where vLLM shares the INT4 server's cores)
    gateway_audit_rate: float | None = None
    gateway_audit_spare_rate: float = 0.5  # the share audited while the pool has room and the budget allows
    corpus_dir: Path | None = None

    @classmethod
    def quick_preset(cls, **kw: Any) -> RemoteValidateConfig:
        from qladder.validate.runner import QUICK_ABNORMAL

        base = cls(quick=True, max_tokens=24, normal_per_class=3, abnormal_per_class=dict(QUICK_ABNORMAL),
                   prompts_per_fault=2, rounds=3, warmup=2, reference_prompts=4, vllm_eager=True)
        return dataclasses.replace(base, **kw)

    def models(self) -> list[FaultModel]:
        return by_name(list(self.fault_names) or [m.name for m in by_name(quick=self.quick) if m.gguf_patch])

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["corpus_dir"] = str(self.corpus_dir) if self.corpus_dir else None
        return d


def load_remote_config(path: Path | None, quick: bool) -> RemoteValidateConfig:
    """The run's settings: the preset, overridden by the TOML's [run], [llama_server], [vllm] and
    [gateway]."""
    base = RemoteValidateConfig.quick_preset() if quick else RemoteValidateConfig()
    if path is None:
        if quick:
            return base
        path = EXAMPLE_CONFIG  # the full run: the bundled example (its values are the defaults)
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    keys = {"run": {"max_tokens", "normal_per_class", "prompts_per_fault", "fault_names", "rounds", "warmup",
                    "clients", "reference_prompts", "request_timeout_s"},
            "llama_server": {"slots": "llama_slots", "threads": "llama_threads", "n_ctx_per_slot": "n_ctx_per_slot"},
            "vllm": {"threads": "vllm_threads", "max_num_seqs": "vllm_max_num_seqs",
                     "kv_cache_gib": "vllm_kv_cache_gib", "eager": "vllm_eager", "url": "vllm_url"},
            "gateway": {"precision": "gateway_precision", "audit_rate": "gateway_audit_rate",
                        "audit_spare_rate": "gateway_audit_spare_rate"}}
    values: dict[str, Any] = {}
    errors = [f"unknown section [{k}]" for k in data if k not in keys]
    for section, known in keys.items():
        table = data.get(section, {})
        mapping = known if isinstance(known, dict) else {k: k for k in known}
        for k, v in table.items():
            if k not in mapping:
                errors.append(f"[{section}] unknown key {k!r} (known: {', '.join(mapping)})")
                continue
            default = getattr(base, mapping[k])
            want = type(default) if default is not None else (float if mapping[k] == "gateway_audit_rate" else str)
            if want is tuple and isinstance(v, list):
                v = tuple(v)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or isinstance(v, bool) != (want is bool):
                errors.append(f"[{section}] {k}: expected {want.__name__}, got {v!r}")
                continue
            values[mapping[k]] = v
    unknown = [f for f in values.get("fault_names", ()) if f not in REMOTE_FAULTS]
    if unknown:
        errors.append(f"[run] fault_names: {unknown} are not faults of a served model ({', '.join(REMOTE_FAULTS)})")
    if values.get("gateway_precision", base.gateway_precision) not in PRECISIONS:
        errors.append(f"[gateway] precision: {values['gateway_precision']!r} is none of {', '.join(PRECISIONS)}")
    for key in ("audit_rate", "audit_spare_rate"):
        rate = values.get(f"gateway_{key}")
        if rate is not None and not 0.0 <= rate <= 1.0:
            errors.append(f"[gateway] {key} must be in [0, 1], got {rate}")
    if errors:
        raise ConfigError(f"{path}: {len(errors)} mistake(s):\n  " + "\n  ".join(errors))
    return dataclasses.replace(base, **values)


# -- processes -------------------------------------------------------------------------------------------

def tree_rss_mb(pid: int) -> float | None:
    """RSS of a process and its descendants (vLLM's engine core is a child of its API server)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
        return float(sum(q.memory_info().rss for q in procs if q.is_running())) / 2**20
    except psutil.Error:
        return None


@dataclass
class Served:
    """One served model: its llama-server and the qladder serve process in front of it."""

    name: str  # "clean", "clean_aa" (no gateway) or the fault model's name
    llama: Any  # LlamaServer: what bare (or bare_aa) asks
    gateway: Any = None  # subprocess.Popen of `qladder serve`
    upstream: Any = None  # the LlamaServer the gateway fronts, where it is not `llama` (clean: a server of its own)
    gateway_url: str = ""
    incidents: Path | None = None
    patch: dict[str, object] | None = None


def gateway_toml(llama_url: str, vllm_url: str, c: RemoteValidateConfig, incidents: Path) -> str:
    return (f'[server]\nincidents = "{incidents}"\ndefault_max_tokens = {c.max_tokens}\n\n'
            f'[model]\nn_ctx = {c.n_ctx_per_slot}\n\n'
            f'[[pools]]\nname = "int4"\nrungs = ["llama-server"]\nurl = "{llama_url}"\nslots = {c.llama_slots}\n'
            f'max_queue = 256\nweight = 1.0\nhandoff_to = "standby"\nprecision = "{c.gateway_precision}"\n'
            + ("" if c.gateway_audit_rate is None else f"audit_rate = {c.gateway_audit_rate}\n")
            + f"audit_spare_rate = {c.gateway_audit_spare_rate}\n\n"
            f'[[pools]]\nname = "standby"\nrungs = ["vllm"]\nurl = "{vllm_url}"\nsessions = {c.vllm_max_num_seqs}\n'
            f'max_queue = 256\n')


def start_gateway(s: Served, vllm_url: str, c: RemoteValidateConfig, work: Path) -> None:
    from qladder.peers.process import start_qladder_serve

    cfg = work / f"serve-{s.name}.toml"
    s.incidents = work / f"incidents-{s.name}.sqlite3"
    cfg.write_text(gateway_toml((s.upstream or s.llama).base_url, vllm_url, c, s.incidents), encoding="utf-8")
    s.gateway, s.gateway_url = start_qladder_serve(cfg, work / f"serve-{s.name}.log")


# -- the prompts as each configuration sends them --------------------------------------------------

@dataclass(frozen=True)
class Forms:
    """One prompt as bare and guarded send it, and the ids and text each engine then decodes from."""

    bare_ids: list[int]  # the template's ids (raw bytes as their bytes' tokens): what bare sends
    bare_text: str  # readable rendering of the prompt as sent
    text: str | None  # what guarded sends as chat text (None: it sends bare_ids as a token-id prompt)
    guarded_ids: list[int]  # the ids the gateway's engine decodes from, after its input defence
    guarded_text: str  # the sanitized prompt


def forms(p: Prompt, info: Any, vocab: Any, preparer: Any, max_tokens: int) -> Forms:
    from qladder.model import user_prompt_ids, user_prompt_ids_bytes
    from qladder.validate.replay import readable, unicode_bytes

    raw = unicode_bytes(p.prompt)
    if raw is not None:
        ids = user_prompt_ids_bytes(info.chat_template, raw, vocab.tokenize, vocab.tokenize_bytes)
        g_ids, reports = preparer.defend_ids(ids, vocab.detokenize_bytes, vocab.control_ids)
        g_text = "\n".join(r.text for r in reports) if reports else vocab.detokenize(g_ids)
        return Forms(ids, readable(p.prompt), None, g_ids, g_text)
    text = p.prompt.decode("utf-8") if isinstance(p.prompt, bytes) else p.prompt
    ids = user_prompt_ids(info.chat_template, text, vocab.tokenize)
    try:
        g_ids, reports = preparer.encode_messages([{"role": "user", "content": text}], max_tokens)
        g_text = "\n".join(r.text for r in reports)
    except InputError:
        g_ids, g_text = [], ""
    return Forms(ids, text, text, g_ids, g_text)


# -- requests ------------------------------------------------------------------------------------------

@dataclass
class Job:
    prompt: Prompt
    phase: str  # warmup | normal | abnormal | faulted
    model: FaultModel | None  # the fault model (None: clean)
    served: str  # which Served answers it
    round: int = 0

    def outcome(self, config: str) -> Outcome:
        p, m = self.prompt, self.model
        return Outcome(RUN, config, p.id, p.cls, "normal" if self.phase in ("normal", "warmup") else "abnormal",
                       fault=m.name if m else None, round=self.round, phase=self.phase, split=p.split,
                       fault_set=m.fault_set if m else None)


def _sse(lines: Any) -> Any:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def bare_request(base_url: str, o: Outcome, f: Forms, max_tokens: int, timeout_s: float, vocab: Any) -> None:
    """One request to llama-server's /completion (token ids in, the server's ids out), streamed.
    llama-server streams no chunk for a token that ends inside a UTF-8 character and then only the
    last token's id: where the ids do not spell the text, the text is re-tokenized (flagged)."""
    o.prompt, o.prompt_tokens, o.token_ids_source = f.bare_text, len(f.bare_ids), "server"
    body = {"prompt": f.bare_ids, "n_predict": max_tokens, "temperature": 0, "seed": 0, "stream": True,
            "return_tokens": True, "cache_prompt": True}
    t0 = time.perf_counter()
    pieces: list[str] = []
    try:
        with httpx.stream("POST", f"{base_url}/completion", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                o.status, o.error = r.status_code, r.text[:160]
            else:
                for chunk in _sse(r.iter_lines()):
                    if chunk.get("content") and o.ttft_ms is None:
                        o.ttft_ms = (time.perf_counter() - t0) * 1e3
                    pieces.append(chunk.get("content") or "")
                    o.token_ids += [int(t) for t in chunk.get("tokens") or []]
                    if chunk.get("stop"):
                        o.finish_reason = {"limit": "length", "eos": "stop", "word": "stop"}.get(
                            str(chunk.get("stop_type")), str(chunk.get("stop_type")))
    except httpx.TimeoutException as exc:
        o.status, o.error = "timeout", type(exc).__name__
    except (httpx.HTTPError, json.JSONDecodeError) as exc:  # a dropped connection, a broken stream
        o.status, o.error = "error", f"connection: {type(exc).__name__}"
    o.latency_ms = (time.perf_counter() - t0) * 1e3
    o.text = "".join(pieces)
    with _VOCAB_LOCK:  # client threads share the harness's vocabulary
        if o.ok and vocab.detokenize_bytes(o.token_ids) != o.text.encode("utf-8"):
            o.token_ids, o.token_ids_source = vocab.tokenize(o.text, False) if o.text else [], "retokenized"
    o.rungs = ["llama-server"] * len(o.token_ids)


def guarded_request(base_url: str, o: Outcome, f: Forms, max_tokens: int, timeout_s: float) -> None:
    """One streamed request to qladder serve with the official client (chat text, or the token-id
    prompt of a prompt that is not valid Unicode), the answer's ids asked for in the extension."""
    import openai

    o.prompt, o.prompt_tokens = f.guarded_text, len(f.guarded_ids)
    extra = {"qladder": {"return_token_ids": True}}
    t0 = time.perf_counter()
    pieces: list[str] = []
    ext: dict[str, Any] = {}
    try:
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=timeout_s) as client:
            common: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                                      "seed": 0, "extra_body": extra}
            stream: Any = (client.chat.completions.create(messages=[{"role": "user", "content": f.text}], **common)
                           if f.text is not None else client.completions.create(prompt=f.bare_ids, **common))
            for ch in stream:
                piece = (ch.choices[0].delta.content if f.text is not None else ch.choices[0].text) \
                    if ch.choices else None
                if piece:
                    if o.ttft_ms is None:
                        o.ttft_ms = (time.perf_counter() - t0) * 1e3
                    pieces.append(piece)
                if ch.model_extra and "qladder" in ch.model_extra:
                    ext = ch.model_extra["qladder"]
    except openai.APITimeoutError as exc:
        o.status, o.error = "timeout", type(exc).__name__
    except openai.APIStatusError as exc:
        o.status, o.error = exc.status_code, str(exc.message)[:160]
    except (openai.APIError, httpx.HTTPError) as exc:  # an error event, a dropped connection
        o.status, o.error = "error", f"{type(exc).__name__}: {exc}"[:160]
    o.latency_ms = (time.perf_counter() - t0) * 1e3
    o.text = "".join(pieces)
    if o.ok and "token_ids" in ext:
        o.token_ids, o.rungs = [int(t) for t in ext["token_ids"]], [str(r) for r in ext["token_rungs"]]
        o.token_ids_source = "server"
    elif o.ok:
        o.status, o.error = "error", "the answer's last chunk carried no qladder extension"
    o.finish_reason = ext.get("finish_reason", o.finish_reason)
    o.fallback = bool(ext.get("fallback"))
    o.hazards = [h["check"] for h in ext.get("hazards", [])]
    o.handoff_ms = [float(h["latency_ms"]) for h in ext.get("handoffs", [])]


# -- judging with the fp32 model on vLLM ---------------------------------------------------------------

class Fp32Judge:
    """The fp32 reference, as vLLM serves it: answer likelihoods and greedy answers by token ids."""

    def __init__(self, vllm_url: str, model: str):
        self.url, self.model = vllm_url, model
        self._nll: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = {}
        self._greedy: dict[tuple[tuple[int, ...], int], list[int] | None] = {}

    def nll(self, prompt: list[int], answer: list[int]) -> float | None:
        """The answer's mean NLL under fp32 (None when scoring failed: the answer is then unjudged)."""
        from qladder.engines.remote_vllm import draft_scores, score_body
        from qladder.validate.garbage import mean_nll

        key = (tuple(prompt), tuple(answer))
        if key not in self._nll:
            try:
                r = httpx.post(f"{self.url}/v1/completions", timeout=300, json=score_body(self.model, prompt, answer))
                r.raise_for_status()
                self._nll[key] = mean_nll([s.logprob for s in draft_scores(r.json(), len(prompt), answer)])
            except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError):
                self._nll[key] = None
        return self._nll[key]

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int] | None:
        """vLLM's greedy answer (None when it cannot give one)."""
        key = (tuple(prompt), max_tokens)
        if max_tokens <= 0:
            return []
        if key not in self._greedy:
            try:
                r = httpx.post(f"{self.url}/v1/completions", timeout=300, json={
                    "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "return_token_ids": True, "skip_special_tokens": False})
                r.raise_for_status()
                choice = r.json()["choices"][0]
                ids = [int(t) for t in choice["token_ids"]]  # missing: a KeyError, not an empty answer
                self._greedy[key] = [t for t in ids if t != 2]  # EOS ends it, as the engines do
            except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError):
                self._greedy[key] = None
        return self._greedy[key]


# -- the run -------------------------------------------------------------------------------------------

@dataclass
class RemoteRun:
    cfg: RemoteValidateConfig
    normal: list[Prompt]
    abnormal: list[Prompt]
    models: list[FaultModel]
    outcomes: list[Outcome] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)  # the prompt ids each outcome's engine decoded from
    served: dict[str, Served] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    drafts: dict[str, dict[str, int]] = field(default_factory=dict)  # per served model: its gateway's draft checks

    def jobs(self) -> tuple[list[Job], list[Job]]:
        """(normal jobs of round 0, abnormal jobs: clean, then each fault set's on its half)."""
        normal = [Job(p, "normal", None, "clean") for p in self.normal]
        abnormal = [Job(p, "abnormal", None, "clean") for p in self.abnormal]
        for fs in FAULT_SETS:
            pool = [p for p in self.abnormal if p.split == fs]
            skip = [i for i, p in enumerate(pool) if p.cls == "over_long"]
            models = [m for m in self.models if m.fault_set == fs]
            for a in assign(len(pool), models, self.cfg.prompts_per_fault, skip, [p.cls for p in pool]):
                abnormal.append(Job(pool[a.prompt_index], "faulted", a.model, a.model.name))
        return normal, abnormal


def run_jobs(run: RemoteRun, jobs: Sequence[Job], config: str, forms_of: Callable[[Prompt], Forms],
             tick: Callable[[], None], vocab: Any) -> None:
    """Every job through one configuration, `clients` at a time; outcomes recorded in job order."""
    c = run.cfg

    def one(j: Job) -> tuple[Outcome, list[int]]:
        o, f = j.outcome(config), forms_of(j.prompt)
        if config == "guarded":
            guarded_request(run.served[j.served].gateway_url, o, f, c.max_tokens, c.request_timeout_s)
            return o, f.guarded_ids
        name = "clean_aa" if config == "bare_aa" else j.served
        bare_request(run.served[name].llama.base_url, o, f, c.max_tokens, c.request_timeout_s, vocab)
        return o, f.bare_ids

    with cf.ThreadPoolExecutor(c.clients, thread_name_prefix=f"client-{config}") as pool:
        for fut in [pool.submit(one, j) for j in jobs]:
            o, ids = fut.result()
            run.outcomes.append(o)
            run.ids.append(ids)
            tick()


def judge_all(run: RemoteRun, judge: Fp32Judge, vocab: Any) -> None:
    """Every answer scored (vLLM's likelihood; a scoring failure leaves it unjudged unless a symptom
    decides) and judged with the run's calibrated threshold (calibration.rejudge); fp32's own
    answers kept as reference ids (abnormal, garbage, guard-ended and reference answers; an answer
    whose ids were re-tokenized from its text is compared with the reference's text re-tokenized
    the same way); each guarded faulted answer's continuation after its llama-server prefix
    compared with vLLM's greedy one."""
    from qladder.validate.calibration import rejudge
    from qladder.validate.garbage import GUARD_ENDED, same_answer
    from qladder.validate.replay import continuation_identical

    refs = {p.id for p in run.normal[: run.cfg.reference_prompts]}
    n = run.cfg.max_tokens
    for o, ids in zip(run.outcomes, run.ids, strict=True):
        if not o.ok or not o.token_ids or o.fallback or o.phase == "warmup" or not ids:
            o.fp32_nll, o.score_failed = None, False
            continue
        nll = judge.nll(ids, o.token_ids)
        o.fp32_nll, o.score_failed = nll, nll is None
    rejudge(run.outcomes)
    for o, ids in zip(run.outcomes, run.ids, strict=True):
        if not o.ok or not o.token_ids or o.fallback or o.phase == "warmup" or not ids:
            continue
        if o.population == "abnormal" or o.garbage or o.finish_reason in GUARD_ENDED or o.prompt_id in refs:
            ref = judge.greedy(ids, n)
            if ref is not None and o.token_ids_source == "retokenized":
                ref = vocab.tokenize(vocab.detokenize(ref), False)
            o.fp32_reference_ids = ref
            o.fp32_identical = None if ref is None else same_answer(o.token_ids, ref, finish=o.finish_reason)
        if o.config == "guarded" and o.fault is not None:
            k = 0
            while k < len(o.rungs) and o.rungs[k] == "llama-server":
                k += 1
            ref = judge.greedy([*ids, *o.token_ids[:k]], n - k)
            o.fp32_continuation_identical = None if ref is None else continuation_identical(
                o.token_ids, k, ref, o.finish_reason)


def validate_remote(cfg: RemoteValidateConfig, out_dir: Path, show_progress: bool = True,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Start the servers, replay, judge; write outcomes.jsonl, results.json, report.md, report.html."""
    from qladder.config import Settings
    from qladder.engines.llamacpp import LlamaVocab
    from qladder.engines.torch_engine import fp32_checkpoint
    from qladder.model import inspect_model
    from qladder.peers import process
    from qladder.peers.llama_server import LlamaServer
    from qladder.peers.vllm import VllmServer
    from qladder.prepare import Preparer
    from qladder.testing.gguf_patch import GGUF_PATCHES
    from qladder.validate.corpora import load_corpora, subset
    from qladder.validate.report import write_remote_report
    from qladder.validate.runner import Progress, write_outputs

    t_start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    normal, abnormal = load_corpora(cfg.corpus_dir)
    run = RemoteRun(cfg, subset(normal, cfg.normal_per_class), subset(abnormal, cfg.abnormal_per_class), cfg.models())
    if any(m.gguf_patch is None for m in run.models):
        raise ConfigError(f"validate --remote takes faults of the served model only ({', '.join(REMOTE_FAULTS)})")
    normal_jobs, abnormal_jobs = run.jobs()
    total = 3 * cfg.warmup + 3 * len(normal_jobs) * cfg.rounds + 2 * len(abnormal_jobs) + 1
    progress = Progress(total, show_progress)
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    vocab = LlamaVocab(info)
    preparer = Preparer(info, vocab.tokenize, cfg.n_ctx_per_slot)
    cache = {p.id: forms(p, info, vocab, preparer, cfg.max_tokens) for p in [*run.normal, *run.abnormal]}

    def forms_of(p: Prompt) -> Forms:  # made here, before any client thread: read-only from there on
        return cache[p.id]

    work = Path(tempfile.mkdtemp(prefix="qladder-remote-"))
    vllm: VllmServer | None = None
    try:
        progress.phase("starting vLLM, llama-server, qladder serve")
        t = time.perf_counter()
        if cfg.vllm_url is None:
            vllm = VllmServer(fp32_checkpoint(info, settings.cache_dir), max_num_seqs=cfg.vllm_max_num_seqs,
                              threads=cfg.vllm_threads, max_model_len=cfg.n_ctx_per_slot,
                              kv_cache_gib=cfg.vllm_kv_cache_gib, log=work / "vllm.log",
                              extra=("--enforce-eager",) if cfg.vllm_eager else ()).start()
        vllm_url = cfg.vllm_url or (vllm.base_url if vllm else "")
        model_id = httpx.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]
        run.times["vllm_start_s"] = time.perf_counter() - t
        ggufs: dict[str, tuple[Path, dict[str, object] | None]] = {"clean": (info.path, None),
                                                                    "clean_aa": (info.path, None)}
        for m in run.models:
            dst = work / f"{m.name}.gguf"
            ggufs[m.name] = (dst, GGUF_PATCHES[m.patch](info.path, dst, **dict(m.gguf_patch or ())))
        t = time.perf_counter()
        for name, (path, applied) in ggufs.items():
            ls = LlamaServer(path, n_parallel=cfg.llama_slots, threads=cfg.llama_threads,
                             n_ctx_per_slot=cfg.n_ctx_per_slot).start()
            run.served[name] = Served(name, ls, patch=applied)
        run.served["clean"].upstream = LlamaServer(info.path, n_parallel=cfg.llama_slots, threads=cfg.llama_threads,
                                                   n_ctx_per_slot=cfg.n_ctx_per_slot).start()
        run.times["llama_server_start_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for s in run.served.values():
            if s.name != "clean_aa":
                start_gateway(s, vllm_url, cfg, work)
        run.times["gateway_start_s"] = time.perf_counter() - t
        replay(run, normal_jobs, abnormal_jobs, forms_of, progress, vocab)
        progress.phase("judge (fp32 on vLLM)")
        t = time.perf_counter()
        judge_all(run, Fp32Judge(vllm_url, model_id), vocab)
        run.times["judge_s"] = time.perf_counter() - t
        memory = {f"llama-server:{n}": tree_rss_mb(s.llama.proc.pid) for n, s in run.served.items()}
        memory |= {f"llama-server:{n}-guarded": tree_rss_mb(s.upstream.proc.pid) for n, s in run.served.items()
                   if s.upstream is not None}
        memory |= {f"qladder-serve:{n}": tree_rss_mb(s.gateway.pid) for n, s in run.served.items() if s.gateway}
        if vllm is not None and vllm.proc is not None:
            memory["vllm"] = tree_rss_mb(vllm.proc.pid)
        servers = describe_servers(run, vllm, vllm_url)
        incidents = {n: _count_incidents(s.incidents) for n, s in run.served.items() if s.gateway}
        run.drafts = {n: _draft_checks(s.gateway_url) for n, s in run.served.items() if s.gateway}
        progress.tick()
    finally:
        progress.close()
        for s in run.served.values():
            process.stop(s.gateway)
            s.llama.stop()
            if s.upstream is not None:
                s.upstream.stop()
        if vllm is not None:
            vllm.stop()
        vocab.close()
        shutil.rmtree(work, ignore_errors=True)
    results = write_outputs(out_dir, run.outcomes, "remote", header(run, memory, servers, incidents))
    results["elapsed_s"] = time.perf_counter() - t_start
    results["phase_durations_s"] = progress.durations
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False, default=str))
    write_remote_report(results, out_dir)
    log(f"wrote {out_dir / 'outcomes.jsonl'}, results.json, report.md, report.html")
    return results


def replay(run: RemoteRun, normal_jobs: list[Job], abnormal_jobs: list[Job], forms_of: Callable[[Prompt], Forms],
           progress: Any, vocab: Any) -> None:
    c = run.cfg
    progress.phase("warm-up")
    warm = [Job(run.normal[i % len(run.normal)], "warmup", None, "clean") for i in range(c.warmup)]
    for config in CONFIGS:
        run_jobs(run, warm, config, forms_of, progress.tick, vocab)
    progress.phase("normal (bare, A/A, guarded, rotated)")
    t = time.perf_counter()
    for r in range(c.rounds):
        jobs = [dataclasses.replace(j, round=r) for j in normal_jobs]
        for config in (*CONFIGS[r % 3:], *CONFIGS[:r % 3]):
            run_jobs(run, jobs, config, forms_of, progress.tick, vocab)
    run.times["normal_s"] = time.perf_counter() - t
    progress.phase("abnormal and faulted")
    t = time.perf_counter()
    for config in ("bare", "guarded"):
        run_jobs(run, abnormal_jobs, config, forms_of, progress.tick, vocab)
    run.times["abnormal_s"] = time.perf_counter() - t


def _draft_checks(gateway_url: str) -> dict[str, int]:
    """The draft-check counters a qladder serve reports on /readyz ({} when it cannot say)."""
    try:
        stats = httpx.get(f"{gateway_url}/readyz", timeout=10).json().get("stats", {})
    except (httpx.HTTPError, ValueError):
        return {}
    return {k.removeprefix("drafts_"): int(v) for k, v in stats.items() if k.startswith("drafts_")}


def _count_incidents(path: Path | None) -> int | None:
    import sqlite3

    if path is None or not path.exists():
        return None
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT COUNT(*) FROM incidents").fetchone()[0])


def describe_servers(run: RemoteRun, vllm: Any, vllm_url: str) -> dict[str, Any]:
    clean = run.served["clean"].llama
    out: dict[str, Any] = {
        "llama_server": {"version": clean.version(), "args": clean.args[1:], "slots": clean.n_parallel,
                         "threads": clean.threads, "binary": str(clean.binary),
                         "models": {n: {"gguf": s.llama.args[2], "patch": s.patch} for n, s in run.served.items()}},
        "vllm": {"url": vllm_url, "started_here": vllm is not None,
                 **(vllm.flags() if vllm is not None else {})},
        "qladder_serve": {"topology": gateway_toml("<llama-server>", "<vllm>", run.cfg, Path("<incidents>")),
                          "processes": sum(1 for s in run.served.values() if s.gateway)},
        "concurrency": {"clients": run.cfg.clients, "mode": "each configuration in turn, clients in parallel"},
    }
    try:
        out["vllm"]["version"] = httpx.get(f"{vllm_url}/version", timeout=10).json()["version"]
    except (httpx.HTTPError, KeyError, ValueError):
        out["vllm"]["version"] = None
    return out


def header(run: RemoteRun, memory: dict[str, float | None], servers: dict[str, Any],
           incidents: dict[str, int | None]) -> dict[str, Any]:
    from qladder.environment import cpu, load_average, versions

    mem_bare = memory.get("llama-server:clean")
    mem_guarded = (mem_bare or 0.0) + (memory.get("qladder-serve:clean") or 0.0) + (memory.get("vllm") or 0.0)
    return {
        "kind": "remote",
        "config": run.cfg.to_dict(),
        "environment": {"versions": versions(), "cpu": cpu(), "load_average_end": load_average(),
                        "servers": servers, "memory_rss_mb": memory},
        "method": {"warmup_requests_per_config": run.cfg.warmup, "rounds_normal": run.cfg.rounds,
                   "sampling": "greedy (temperature 0, seed 0)", "clients": run.cfg.clients,
                   "prompts": {"normal": len(run.normal), "abnormal": len(run.abnormal)},
                   "order": "normal rounds rotate bare, bare_aa and guarded; abnormal and faulted requests once "
                            "per configuration",
                   "memory_note": "RSS of each process tree after the run: bare = the clean llama-server; guarded "
                                  "= the clean llama-server + its qladder serve + vLLM",
                   "faults_note": "faults in the served model only (patched GGUF copies): a bare server cannot "
                                  "take per-request faults"},
        "memory_mb": {"bare": mem_bare, "guarded": mem_guarded},
        "fault_models": [{**fm.to_dict(), "applied_patch": run.served[fm.name].patch if fm.name in run.served
                          else None} for fm in run.models],
        "incidents_recorded": incidents,
        "draft_checks": run.drafts,
        "phase_times_s": run.times,
    }
