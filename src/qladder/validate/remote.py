"""`qladder validate --remote`: the write-up's table on real serving engines, over HTTP.

    bare     clients -> llama-server's /v1/chat/completions         (a user without qladder)
    guarded  clients -> qladder serve -> llama-server (INT4 pool) -> vLLM (the fp32 standby)

Both configurations see the same llama-server processes: one on the embedded GGUF for the clean
traffic, one per GGUF fault model (a corrupted scale, an inf scale, glitch-token embeddings) on
its patched copy, each fronted by a `qladder serve` process of its own, all sharing one vLLM
standby. Per-request faults (nan@step and the like) are not part of this run: a bare server
cannot be made to take them, so only faults in the served model itself are compared.

Requests stream with the official `openai` client from `clients` threads at once (production
traffic arrives in parallel). Normal prompts run `rounds` times, bare and guarded alternating
which goes first; abnormal prompts (with and without a fault model) run once per configuration.
Answers are judged by the same independent judge as the in-process run (`validate/garbage.py`),
the likelihood judge scores them under the fp32 model served by vLLM (`prompt_logprobs`), and a
guarded garbage answer that vLLM's own greedy answer repeats is the model's own. results.json has
the in-process run's shape for `bare` and `guarded`, plus `p99_ratio_gateway_over_bare`, every
process's memory, and the servers' versions, flags and threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import shutil
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from qladder.errors import ConfigError, InputError
from qladder.validate.corpora import Prompt
from qladder.validate.fault_models import FaultModel, assign, by_name
from qladder.validate.replay import Outcome

REMOTE_FAULTS = ("corrupted_scale", "inf_scale", "glitch_tokens")  # faults in the served model itself
EXAMPLE_CONFIG = Path(__file__).with_name("remote_example.toml")


@dataclass(frozen=True)
class RemoteValidateConfig:
    quick: bool = False
    max_tokens: int = 32
    normal_per_class: int = 12
    abnormal_per_class: dict[str, int] | int = 3
    prompts_per_fault: int = 4
    fault_names: tuple[str, ...] = REMOTE_FAULTS
    rounds: int = 3
    warmup: int = 4
    clients: int = 4  # concurrent client threads (each configuration in turn)
    llama_slots: int = 4  # llama-server -np
    llama_threads: int = 1  # -t / -tb
    n_ctx_per_slot: int = 2048
    vllm_threads: int = 1
    vllm_max_num_seqs: int = 8
    vllm_kv_cache_gib: int = 1
    vllm_eager: bool = False  # --enforce-eager: starts in ~30 s instead of ~80-100 s, ~10% slower
    vllm_url: str | None = None  # a running vLLM on the same fp32 weights (else started here)
    corpus_dir: Path | None = None

    @classmethod
    def quick_preset(cls, **kw: Any) -> RemoteValidateConfig:
        from qladder.validate.runner import QUICK_ABNORMAL

        base = cls(quick=True, max_tokens=24, normal_per_class=3, abnormal_per_class=dict(QUICK_ABNORMAL),
                   prompts_per_fault=2, rounds=3, warmup=2, vllm_eager=True)
        return dataclasses.replace(base, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["corpus_dir"] = str(self.corpus_dir) if self.corpus_dir else None
        return d


def load_remote_config(path: Path | None, quick: bool) -> RemoteValidateConfig:
    """The run's settings: the preset, overridden by the TOML's [run], [llama_server] and [vllm]."""
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
                    "clients"},
            "llama_server": {"slots": "llama_slots", "threads": "llama_threads", "n_ctx_per_slot": "n_ctx_per_slot"},
            "vllm": {"threads": "vllm_threads", "max_num_seqs": "vllm_max_num_seqs",
                     "kv_cache_gib": "vllm_kv_cache_gib", "eager": "vllm_eager", "url": "vllm_url"}}
    values: dict[str, Any] = {}
    errors = [f"unknown section [{k}]" for k in data if k not in keys]
    for section, known in keys.items():
        table = data.get(section, {})
        mapping = known if isinstance(known, dict) else {k: k for k in known}
        for k, v in table.items():
            if k not in mapping:
                errors.append(f"[{section}] unknown key {k!r} (known: {', '.join(mapping)})")
                continue
            want = type(getattr(base, mapping[k])) if getattr(base, mapping[k]) is not None else str
            if want is tuple and isinstance(v, list):
                v = tuple(v)
            if not isinstance(v, want) or isinstance(v, bool) != (want is bool):
                errors.append(f"[{section}] {k}: expected {want.__name__}, got {v!r}")
                continue
            values[mapping[k]] = v
    unknown = [f for f in values.get("fault_names", ()) if f not in REMOTE_FAULTS]
    if unknown:
        errors.append(f"[run] fault_names: {unknown} are not faults of a served model ({', '.join(REMOTE_FAULTS)})")
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
        return sum(q.memory_info().rss for q in procs if q.is_running()) / 2**20
    except psutil.Error:
        return None


@dataclass
class Served:
    """One served model: its llama-server and the qladder serve process in front of it."""

    name: str  # "clean" or the fault model's name
    llama: Any  # LlamaServer
    gateway: Any = None  # subprocess.Popen of `qladder serve`
    gateway_url: str = ""
    incidents: Path | None = None
    patch: dict[str, object] | None = None


def _gateway_toml(llama_url: str, vllm_url: str, c: RemoteValidateConfig, incidents: Path) -> str:
    return (f'[server]\nincidents = "{incidents}"\ndefault_max_tokens = {c.max_tokens}\n\n'
            f'[model]\nn_ctx = {c.n_ctx_per_slot}\n\n'
            f'[[pools]]\nname = "int4"\nrungs = ["llama-server"]\nurl = "{llama_url}"\nslots = {c.llama_slots}\n'
            f'max_queue = 256\nweight = 1.0\nhandoff_to = "standby"\n\n'
            f'[[pools]]\nname = "standby"\nrungs = ["vllm"]\nurl = "{vllm_url}"\nsessions = {c.vllm_max_num_seqs}\n'
            f'max_queue = 256\n')


def start_gateway(s: Served, vllm_url: str, c: RemoteValidateConfig, work: Path) -> None:
    import subprocess
    import sys

    from qladder.errors import EngineError
    from qladder.peers.process import free_port, wait_ready

    cfg = work / f"serve-{s.name}.toml"
    s.incidents = work / f"incidents-{s.name}.sqlite3"
    cfg.write_text(_gateway_toml(s.llama.base_url, vllm_url, c, s.incidents), encoding="utf-8")
    port = free_port()
    with open(work / f"serve-{s.name}.log", "wb") as log:  # the child keeps its own descriptor
        s.gateway = subprocess.Popen([sys.executable, "-m", "qladder", "serve", "--config", str(cfg), "--host",
                                      "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    s.gateway_url = f"http://127.0.0.1:{port}"
    why = wait_ready(s.gateway, f"{s.gateway_url}/readyz", 180, poll_s=0.2)
    if why is not None:
        raise EngineError(f"qladder serve for {s.name} {why}; see {work / f'serve-{s.name}.log'}")


# -- requests ------------------------------------------------------------------------------------------

@dataclass
class Job:
    prompt: Prompt
    population: str  # normal | abnormal
    fault: str  # "none" or the fault model's name
    served: str  # which Served answers it
    round: int = 0


def _text(p: Prompt) -> str:
    """The prompt as a client can send it: valid UTF-8 (raw bytes and lone surrogates replaced)."""
    raw = p.prompt if isinstance(p.prompt, bytes) else p.prompt.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def one_request(base_url: str, config: str, job: Job, max_tokens: int, tokenize: Callable[[str], list[int]]
                ) -> Outcome:
    """One streamed chat request with the official client; never raises (failures are outcomes)."""
    import openai

    o = Outcome(config, job.prompt.id, job.prompt.cls, job.population, job.fault, "ok", round=job.round)
    t0 = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    ext: dict[str, Any] = {}
    try:
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600) as client:
            stream = client.chat.completions.create(
                model="smollm2-135m-instruct", stream=True, max_tokens=max_tokens, temperature=0, seed=0,
                messages=[{"role": "user", "content": _text(job.prompt)}])
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(ch.choices[0].delta.content)
                if ch.choices and ch.choices[0].finish_reason:
                    o.finish_reason = ch.choices[0].finish_reason
                if ch.model_extra and "qladder" in ch.model_extra:
                    ext = ch.model_extra["qladder"]
    except openai.APIStatusError as exc:
        o.status = "error" if exc.status_code >= 500 else "rejected"
        o.error_kind = f"http_{exc.status_code}"
    except (openai.APIError, httpx.HTTPError) as exc:  # a dropped connection, a broken stream
        o.status, o.error_kind = "error", f"connection:{type(exc).__name__}"
    o.wall_ms = (time.perf_counter() - t0) * 1e3
    o.prefill_ms = ((first or time.perf_counter()) - t0) * 1e3
    o.text = "".join(pieces)
    o.token_ids = tokenize(o.text) if o.text else []
    if ext:
        o.finish_reason = ext.get("finish_reason", o.finish_reason)
        o.fallback = bool(ext.get("fallback"))
        o.hazards = [h["check"] for h in ext.get("hazards", [])]
        o.handoff_ms = [float(h["latency_ms"]) for h in ext.get("handoffs", [])]
        o.token_rungs = [r for r, n in (ext.get("tokens_per_rung") or {}).items() for _ in range(int(n))]
    elif config == "bare":
        o.token_rungs = ["llama-server"] * len(o.token_ids)
    return o


def run_jobs(jobs: Sequence[Job], url_of: Callable[[Job], str], config: str, c: RemoteValidateConfig,
             tokenize: Callable[[str], list[int]], tick: Callable[[], None]) -> list[Outcome]:
    """Every job through one configuration, `clients` at a time."""
    with cf.ThreadPoolExecutor(c.clients, thread_name_prefix=f"client-{config}") as pool:
        futures = [pool.submit(one_request, url_of(j), config, j, c.max_tokens, tokenize) for j in jobs]
        out = []
        for f in futures:
            out.append(f.result())
            tick()
    return out


# -- judging with the fp32 model on vLLM ---------------------------------------------------------------

class Fp32Judge:
    """The fp32 reference, as vLLM serves it: answer likelihoods and greedy answers by token ids."""

    def __init__(self, vllm_url: str, model: str):
        self.url, self.model = vllm_url, model
        self._nll: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = {}
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def nll(self, prompt: list[int], answer: list[int]) -> float | None:
        from qladder.engines.remote_vllm import draft_logprobs, score_body
        from qladder.validate.garbage import mean_nll

        key = (tuple(prompt), tuple(answer))
        if not prompt:
            return None
        if key not in self._nll:
            try:
                r = httpx.post(f"{self.url}/v1/completions", timeout=300, json=score_body(self.model, prompt, answer))
                r.raise_for_status()
                self._nll[key] = mean_nll(draft_logprobs(r.json(), len(prompt), answer))
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                self._nll[key] = None  # too long to score: judged by its symptoms alone
        return self._nll[key]

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """vLLM's greedy answer ([] when it cannot give one: the answer is then not the model's own)."""
        key = tuple(prompt)
        if key not in self._greedy:
            try:
                r = httpx.post(f"{self.url}/v1/completions", timeout=300, json={
                    "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "return_token_ids": True, "skip_special_tokens": False})
                r.raise_for_status()
                self._greedy[key] = [int(t) for t in r.json()["choices"][0].get("token_ids") or []]
            except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError):
                self._greedy[key] = []
        return self._greedy[key]


# -- the run -------------------------------------------------------------------------------------------

@dataclass
class RemoteRun:
    cfg: RemoteValidateConfig
    normal: list[Prompt]
    abnormal: list[Prompt]
    models: list[FaultModel]
    outcomes: list[Outcome] = field(default_factory=list)
    served: dict[str, Served] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    drafts: dict[str, dict[str, int]] = field(default_factory=dict)  # per served model: its gateway's draft checks

    def jobs(self) -> tuple[list[Job], list[Job]]:
        """(normal jobs of round 0, abnormal jobs: clean and faulted)."""
        normal = [Job(p, "normal", "none", "clean") for p in self.normal]
        abnormal = [Job(p, "abnormal", "none", "clean") for p in self.abnormal]
        skip = [i for i, p in enumerate(self.abnormal) if p.cls == "over_long"]
        for a in assign(len(self.abnormal), self.models, self.cfg.prompts_per_fault, skip,
                        [p.cls for p in self.abnormal]):
            abnormal.append(Job(self.abnormal[a.prompt_index], "abnormal", a.model.name, a.model.name))
        return normal, abnormal


def validate_remote(cfg: RemoteValidateConfig, out_dir: Path, show_progress: bool = True,
                    log: Callable[[str], None] = lambda s: None, beside: Path | None = None) -> dict[str, Any]:
    """Start the servers, replay, judge; write results.json, report.md and report.html."""
    from qladder.config import Settings
    from qladder.engines.llamacpp import LlamaVocab
    from qladder.engines.torch_engine import fp32_checkpoint
    from qladder.faults import GGUF_PATCHES
    from qladder.model import inspect_model, user_prompt_ids
    from qladder.peers import process
    from qladder.peers.llama_server import LlamaServer
    from qladder.peers.vllm import VllmServer
    from qladder.prepare import Preparer
    from qladder.validate.corpora import load_corpora, subset
    from qladder.validate.report import write_remote_report
    from qladder.validate.runner import Progress, write_outputs

    t_start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    normal, abnormal = load_corpora(cfg.corpus_dir)
    run = RemoteRun(cfg, subset(normal, cfg.normal_per_class), subset(abnormal, cfg.abnormal_per_class),
                    by_name(list(cfg.fault_names)))
    if any(m.gguf_patch is None for m in run.models):
        raise ConfigError(f"validate --remote takes faults of the served model only ({', '.join(REMOTE_FAULTS)})")
    normal_jobs, abnormal_jobs = run.jobs()
    total = 2 * (cfg.warmup + len(normal_jobs) * cfg.rounds + len(abnormal_jobs)) + 1
    progress = Progress(total, show_progress)
    settings = Settings.from_env()
    info = inspect_model(None, settings.cache_dir)
    vocab = LlamaVocab(info)
    work = Path(tempfile.mkdtemp(prefix="qladder-remote-"))
    vllm: VllmServer | None = None
    servers: dict[str, Any] = {}
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
        ggufs: dict[str, tuple[Path, dict[str, object] | None]] = {"clean": (info.path, None)}
        for m in run.models:
            dst = work / f"{m.name}.gguf"
            applied = GGUF_PATCHES[m.patch](info.path, dst, **dict(m.gguf_patch or ()))
            ggufs[m.name] = (dst, applied)
        t = time.perf_counter()
        for name, (path, applied) in ggufs.items():
            ls = LlamaServer(path, n_parallel=cfg.llama_slots, threads=cfg.llama_threads,
                             n_ctx_per_slot=cfg.n_ctx_per_slot).start()
            run.served[name] = Served(name, ls, patch=applied)
        run.times["llama_server_start_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for s in run.served.values():
            start_gateway(s, vllm_url, cfg, work)
        run.times["gateway_start_s"] = time.perf_counter() - t

        def tokenize(text: str) -> list[int]:
            return vocab.tokenize(text, False)

        def url_of(config: str) -> Callable[[Job], str]:
            return (lambda j: run.served[j.served].llama.base_url) if config == "bare" \
                else (lambda j: run.served[j.served].gateway_url)

        progress.phase("warm-up")
        warm = [Job(run.normal[i % len(run.normal)], "normal", "none", "clean") for i in range(cfg.warmup)]
        for config in ("bare", "guarded"):
            run_jobs(warm, url_of(config), config, cfg, tokenize, progress.tick)
        progress.phase("normal (bare and guarded, alternating)")
        t = time.perf_counter()
        for r in range(cfg.rounds):
            jobs = [dataclasses.replace(j, round=r) for j in normal_jobs]
            for config in (("bare", "guarded") if r % 2 == 0 else ("guarded", "bare")):
                run.outcomes += run_jobs(jobs, url_of(config), config, cfg, tokenize, progress.tick)
        run.times["normal_s"] = time.perf_counter() - t
        progress.phase("abnormal and faulted")
        t = time.perf_counter()
        for config in ("bare", "guarded"):
            run.outcomes += run_jobs(abnormal_jobs, url_of(config), config, cfg, tokenize, progress.tick)
        run.times["abnormal_s"] = time.perf_counter() - t
        progress.phase("judge (fp32 on vLLM)")
        judge = Fp32Judge(vllm_url, model_id)
        prompts = {p.id: p for p in [*run.normal, *run.abnormal]}
        t = time.perf_counter()
        preparer = Preparer(info, vocab.tokenize, cfg.n_ctx_per_slot)

        def prompt_ids(config: str, p: Prompt) -> list[int]:
            if config == "bare":  # llama-server renders the GGUF's template over the raw text
                return user_prompt_ids(info.chat_template, _text(p), vocab.tokenize)
            try:
                return preparer.encode_messages([{"role": "user", "content": _text(p)}], cfg.max_tokens)[0]
            except InputError:
                return []

        judge_all(run, judge, prompt_ids, vocab.detokenize, prompts)
        run.times["judge_s"] = time.perf_counter() - t
        memory = {f"llama-server:{n}": tree_rss_mb(s.llama.proc.pid) for n, s in run.served.items()}
        memory |= {f"qladder-serve:{n}": tree_rss_mb(s.gateway.pid) for n, s in run.served.items()}
        if vllm is not None and vllm.proc is not None:
            memory["vllm"] = tree_rss_mb(vllm.proc.pid)
        servers = describe_servers(run, vllm, vllm_url)
        incidents = {n: _count_incidents(s.incidents) for n, s in run.served.items()}
        run.drafts = {n: _draft_checks(s.gateway_url) for n, s in run.served.items()}
        progress.tick()
    finally:
        progress.close()
        for s in run.served.values():
            process.stop(s.gateway)
            s.llama.stop()
        if vllm is not None:
            vllm.stop()
        vocab.close()
        shutil.rmtree(work, ignore_errors=True)
    results = assemble_remote(run, memory, servers, incidents)
    results["elapsed_s"] = time.perf_counter() - t_start
    results["phase_durations_s"] = progress.durations
    if beside is not None and beside.is_file():
        results["beside_in_process"] = _beside(json.loads(beside.read_text(encoding="utf-8")), str(beside))
    write_outputs(out_dir, results, run.outcomes)
    write_remote_report(results, out_dir)
    log(f"wrote {out_dir / 'results.json'}, report.md, report.html")
    return results


def judge_all(run: RemoteRun, judge: Fp32Judge, prompt_ids: Callable[[str, Prompt], list[int]],
              detokenize: Callable[[list[int]], str], prompts: dict[str, Prompt]) -> None:
    """Symptoms for every answer; the fp32 likelihood for abnormal ones; and whose a guarded garbage
    answer is (vLLM's fp32 greedy answer to the same ids shows the same symptoms: the model's own).
    `prompt_ids(config, prompt)`: the ids that configuration's server decoded from (guarded: after
    the input defence)."""
    from qladder.validate.garbage import judge as judge_text

    for o in run.outcomes:
        if o.population == "abnormal" and o.status == "ok" and o.token_ids:
            o.nll = judge.nll(prompt_ids(o.config, prompts[o.prompt_id]), o.token_ids)
        o.judge()
    for o in run.outcomes:
        if o.config == "guarded" and o.is_garbage:
            ref = judge.greedy(prompt_ids("guarded", prompts[o.prompt_id]), run.cfg.max_tokens)
            reasons = judge_text(detokenize(ref), ref, len(ref) >= run.cfg.max_tokens).reasons
            o.model_own = bool(ref) and bool(set(o.garbage) & set(reasons))


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
        "qladder_serve": {"topology": _gateway_toml("<llama-server>", "<vllm>", run.cfg, Path("<incidents>")),
                          "processes": len(run.served)},
        "concurrency": {"clients": run.cfg.clients, "mode": "each configuration in turn, clients in parallel"},
    }
    try:
        out["vllm"]["version"] = httpx.get(f"{vllm_url}/version", timeout=10).json()["version"]
    except (httpx.HTTPError, KeyError, ValueError):
        out["vllm"]["version"] = None
    return out


def assemble_remote(run: RemoteRun, memory: dict[str, float | None], servers: dict[str, Any],
                    incidents: dict[str, int | None]) -> dict[str, Any]:
    from qladder.percentiles import percentile
    from qladder.validate.environment import cpu, load_average, versions
    from qladder.validate.stats import paired_ratio, section

    bare = [o for o in run.outcomes if o.config == "bare"]
    guarded = [o for o in run.outcomes if o.config == "guarded"]
    mem_bare = sum(v or 0.0 for k, v in memory.items() if k.startswith("llama-server"))
    mem_guarded = mem_bare + sum(v or 0.0 for k, v in memory.items() if not k.startswith("llama-server"))
    ratios = paired_ratio(bare, guarded)
    return {
        "kind": "remote",
        "config": run.cfg.to_dict(),
        "environment": {"versions": versions(), "cpu": cpu(), "load_average_end": load_average(),
                        "servers": servers, "memory_rss_mb": memory},
        "method": {"warmup_requests_per_config": run.cfg.warmup, "rounds_normal": run.cfg.rounds,
                   "sampling": "greedy (temperature 0, seed 0)", "clients": run.cfg.clients,
                   "prompts": {"normal": len(run.normal), "abnormal": len(run.abnormal)},
                   "order": "normal rounds alternate which configuration goes first; abnormal and faulted "
                            "requests once per configuration",
                   "memory_note": "RSS of each process tree after the run: bare = the llama-servers; guarded "
                                  "= the llama-servers + vLLM + the qladder serve processes",
                   "faults_note": "faults in the served model only (patched GGUF copies): a bare server cannot "
                                  "take per-request faults"},
        "fault_models": [{**fm.to_dict(), "applied_patch": run.served[fm.name].patch if fm.name in run.served
                          else None} for fm in run.models],
        "bare": section(bare, None, mem_bare),
        "guarded": section(guarded, None, mem_guarded),
        "latency_ratio_guarded_over_bare": ratios,
        "p99_ratio_gateway_over_bare": ratios["p99"],
        # time to the first text a client receives (the gateway holds the first 8 tokens on the
        # INT4 rung for the draft check, then 7 behind: its per-token decode figure leaves those
        # out; read the end-to-end rows)
        "ttft_normal_ms": {cfg: {"p50": percentile(t, 50), "p99": percentile(t, 99)} for cfg, t in (
            (c, [o.prefill_ms for o in outs if o.population == "normal" and o.fault == "none" and o.status == "ok"])
            for c, outs in (("bare", bare), ("guarded", guarded)))},
        "latency_samples_normal_ms": {cfg: [o.wall_ms for o in outs if o.population == "normal"
                                            and o.fault == "none" and o.status == "ok"]
                                      for cfg, outs in (("bare", bare), ("guarded", guarded))},
        "incidents_recorded": incidents,
        # per qladder serve: answers' first tokens vLLM scored (passed/refused/unchecked), released
        # unscored (confident) or not held (skipped: a prompt over verify_max_context)
        "draft_checks": run.drafts,
        "phase_times_s": run.times,
    }


def _beside(r: dict[str, Any], path: str) -> dict[str, Any]:
    """The in-process run's headline numbers, for the table beside this one."""
    pick = ("garbage_rate", "garbage_beyond_fp32_rate", "error_rate", "fallback", "memory_rss_mb")
    return {"path": path, "quick": r.get("config", {}).get("quick"),
            **{cfg: {k: r.get(cfg, {}).get(k) for k in pick} | {"p99_ms": r.get(cfg, {}).get(
                "latency_normal", {}).get("p99_ms")} for cfg in ("bare", "guarded")},
            "p99_ratio": (r.get("latency_ratio_guarded_over_bare") or {}).get("p99")}
