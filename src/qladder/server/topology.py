"""The server's topology, from a TOML file: pools of rungs, routing weights, breakers, quarantine,
cores, shared state. Every key, its default and what it trades is declared once, with its doc, on the
fields below (and in breaker.py, quarantine.py, shared_state.py); docs/CONFIG.md is generated from
them (`qladder config reference`, qladder.server.config_reference).

With no file, the defaults serve the embedded model on the machine's cores: the standby on one
thread, INT4 on the others, and on all of them while the standby has nothing to do (on 2 cores:
INT4 on 2 threads while idle, 1 + 1 while a handoff, a verified window or an audit runs). In front
of servers a team already runs: `rungs = ["llama-server"]` (INT4) or `["vllm"]` (the standby) with
`url` (or `urls`, replicas). Every mistake in a file is reported at start-up, one line each.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qladder.config import knob
from qladder.errors import ConfigError
from qladder.server.breaker import BreakerConfig
from qladder.server.quarantine import QuarantineConfig
from qladder.server.shared_state import StateSettings
from qladder.types import DEFAULT_MAX_TOKENS

INT4_RUNGS = ("int4", "llama-server")  # in-process, or a remote llama.cpp server (`url`)
MIDDLE_RUNGS = ("int8",)  # a standby's first rung under full precision: the model's Q8_0 level (levels.py)
FULL_RUNGS = ("fp32", "bf16", "w4a16", "vllm")  # in-process torch, or a remote vLLM server (`url`)
REMOTE_RUNGS = ("llama-server", "vllm")
PRECISIONS = ("fast", "verified")
# The audit's floor: the share of an INT4 pool's answers (in-process, or llama-server replicas)
# scored by the standby (in-process, or vLLM) when the pool does not set audit_rate (its cost is
# measured by bench serve --box and bench verified's int4-audit configuration; detection takes
# about 1 / AUDIT_FLOOR answers to the first audited one, then every answer is audited until the
# test decides)
AUDIT_FLOOR = 0.05


@dataclass(frozen=True)
class PoolConfig:
    """One table per pool: the INT4 pool (rung int4, or llama-server over `url`/`urls`) or the standby
    (fp32, bf16, w4a16, int8 under them, or vllm over `url`/`urls`)."""

    name: str = knob("", "the pool's name: routing, metrics and handoff_to refer to it", required=True)
    rungs: tuple[str, ...] = knob((), "its rungs, lowest first: [\"int4\"] or [\"llama-server\"] for "
                                      "the INT4 pool; [\"fp32\"], [\"int8\", \"fp32\"] (INT4 -> INT8 -> FP32) or "
                                      "[\"vllm\"] for the standby", required=True)
    threads: int = knob(1, "a standby's threads (an in-process INT4 pool's are [cores] int4; `threads = N` "
                           "there means int4 = N)")
    slots: int = knob(8, "an INT4 pool's sequences batched together on one llama.cpp context")
    sessions: int = knob(4, "a standby's requests stepped at once; more wait in its FIFO queue")
    max_queue: int = knob(64, "requests waiting beyond the slots (sessions); past it, 429")
    weight: float = knob(0.0, "the share of new requests routed here (the INT4 pool: 1.0 by default); 0: "
                              "capacity reserved for handoffs and quarantined prompts")
    handoff_to: str | None = knob(None, "the pool that catches this pool's handoffs (the INT4 pool: "
                                        "\"standby\" by default)")
    url: str | None = knob(None, "a remote rung's server: http://host:port of a llama-server or vLLM")
    urls: tuple[str, ...] = knob((), "or replicas of it on the same weights: one stream, any replica; a dead "
                                     "one's streams go on at a sibling, a corrupted one is ejected by the audit")
    precision: str = knob("fast", "an INT4 pool's decode mode: \"fast\" (INT4's tokens under the step guard) "
                                  "or \"verified\" (INT4 drafts, the standby's first rung decides every token: "
                                  "full precision's answer); a request may ask with \"qladder\": {\"precision\": ...}")
    audit_rate: float | None = knob(None, "the share of an INT4 pool's answers always scored teacher-forced by "
                                          "the standby, off the request path (unset: 0.05 where a standby has a "
                                          "full-precision rung, else 0)")
    audit_spare_rate: float = knob(0.5, "the share audited instead while the pool has a free slot and the audit "
                                        "is within audit_budget")
    audit_budget: float = knob(0.1, "the audit's core-time over the last 30 s beyond the floor, as a share of "
                                    "the box's cores: what the audit may cost INT4's throughput")
    detect: bool = knob(True, "the audit's sequential test (a CUSUM, health/detector.py) ejects this pool (a "
                              "replica) whose answers full precision finds unlikely, until audited probes pass")
    prompt_cache_mb: int = knob(512, "an in-process INT4 pool: prompts' KV states kept after their prefill, so "
                                     "the same prompt again is restored (~23 KB a token for the embedded model); "
                                     "0: off")

    def audit_share(self, standby: PoolConfig | None) -> float:
        """The share of this pool's answers audited: its audit_rate, or the floor where a standby
        scores its answers (in-process full precision's batched forward, or vLLM's prompt logprobs)."""
        if self.audit_rate is not None:
            return self.audit_rate
        scores = standby is not None and any(r in FULL_RUNGS for r in standby.rungs)
        return AUDIT_FLOOR if self.kind == "int4" and scores else 0.0

    @property
    def kind(self) -> str:
        return "int4" if self.rungs and self.rungs[0] in INT4_RUNGS else "standby"

    @property
    def endpoints(self) -> str | tuple[str, ...] | None:
        """The remote rung's server (`url`), its replicas (`urls`), or None (in-process)."""
        return self.urls or self.url


@dataclass(frozen=True)
class ServerSettings:
    """The gateway's own settings."""

    model_name: str = knob("smollm2-135m-instruct", "the id clients pass as `model`")
    max_body_bytes: int = knob(1 << 20, "larger request bodies get 413")
    default_max_tokens: int = knob(DEFAULT_MAX_TOKENS, "an answer's bound when a request gives no max_tokens")
    drain_timeout_s: float = knob(30.0, "on SIGTERM, in-flight streams get this long to finish")
    incidents: str = knob("", "the incident store: a SQLite path or a postgresql:// URL (\"\": "
                              "<cache>/incidents.sqlite3); `qladder serve --incidents` overrides it")
    redact: bool = knob(False, "keep only prompts' fingerprints in the incident store (`--redact`)")
    allow_faults: bool = knob(False, "let requests inject faults: validation and load tests only, never in "
                                     "production (`--allow-faults`)")
    guard: str = knob("default", "the step guard's preset: default, logits, strict, off")
    sanitize: str = knob("default", "the input defence's preset: default, strict, off")
    verify_below: float | None = knob(None, "a prompt class whose audited agreement (last 200 greedy answers, at "
                                            "least 20) falls under this is served verified (0: never; unset: the "
                                            "bound calibrated on the train half, health/detector_calibration.json)")


@dataclass(frozen=True)
class CoresSettings:
    """The machine's cores, shared by the in-process INT4 pool and standby."""

    total: int = knob(0, "the cores to share (0: the CPUs this process may run on; a container's CPU quota is "
                         "not read: set it there)")
    int4: str | int = knob("elastic", "\"elastic\": INT4 decodes on every core the standby is not using (all of "
                                      "them while it is idle); or N: N threads, fixed. Elastic needs an in-process "
                                      "INT4 pool and standby (a remote pool's cores are its server's)")
    linger_s: float = knob(0.25, "elastic: INT4 keeps to its share this long after the standby's last work")

    @property
    def cpus(self) -> int:
        """`total`, or the CPUs this process may run on (its affinity; a container's CPU quota is
        not read: set `total` there)."""
        if self.total:
            return self.total
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            return os.cpu_count() or 1


@dataclass(frozen=True)
class ModelSettings:
    """The weights in-process rungs load."""

    path: str = knob("", "a Llama-family GGUF (\"\": the embedded SmolLM2-135M-Instruct Q4_1)")
    n_ctx: int = knob(2048, "the context per slot")


def remote_topology(llama_url: str, vllm_url: str | tuple[str, ...], **server: Any) -> Topology:
    """The topology in front of two serving engines: an INT4 pool ("edge", 4 slots) on a
    llama-server handing off to a full-precision pool ("gpu", 4 sessions) on a vLLM (or on
    replicas of it: a tuple of urls), with `server` replacing [server] settings (benchmarks and tests)."""
    t = Topology()
    gpu = (PoolConfig("gpu", ("vllm",), sessions=4, urls=vllm_url) if isinstance(vllm_url, tuple)
           else PoolConfig("gpu", ("vllm",), sessions=4, url=vllm_url))
    pools = (PoolConfig("edge", ("llama-server",), slots=4, weight=1.0, handoff_to="gpu", url=llama_url), gpu)
    return replace(t, pools=pools, server=replace(t.server, **server))


def default_pools() -> tuple[PoolConfig, ...]:
    return (PoolConfig("int4", ("int4",), threads=1, slots=8, max_queue=64, weight=1.0, handoff_to="standby"),
            PoolConfig("standby", ("fp32",), threads=1, sessions=4, max_queue=256, weight=0.0))


@dataclass(frozen=True)
class Topology:
    """The whole file: its sections (config_reference.SECTIONS documents them in this order)."""

    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    pools: tuple[PoolConfig, ...] = field(default_factory=default_pools)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    quarantine: QuarantineConfig = field(default_factory=QuarantineConfig)
    cores: CoresSettings = field(default_factory=CoresSettings)
    state: StateSettings = field(default_factory=StateSettings)

    @property
    def int4(self) -> PoolConfig:
        return next(p for p in self.pools if p.kind == "int4")

    @property
    def standby(self) -> PoolConfig | None:
        return next((p for p in self.pools if p.kind == "standby"), None)


def load_topology(path: str | Path | None) -> Topology:
    """The topology in `path` (None: the defaults). Raises ConfigError listing every mistake."""
    if path is None:
        return Topology()
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_topology(data, str(path))


def parse_topology(data: dict[str, Any], where: str = "config") -> Topology:
    errors: list[str] = []
    known = {"server", "model", "pools", "breaker", "quarantine", "cores", "state"}
    for key in sorted(set(data) - known):
        errors.append(f"unknown section [{key}] (known: {', '.join(sorted(known))})")
    server = _section(data.get("server", {}), ServerSettings, "server", errors)
    model = _section(data.get("model", {}), ModelSettings, "model", errors)
    breaker = _section(data.get("breaker", {}), BreakerConfig, "breaker", errors)
    quarantine = _section(data.get("quarantine", {}), QuarantineConfig, "quarantine", errors)
    cores = _section(data.get("cores", {}), CoresSettings, "cores", errors)
    state = _section(data.get("state", {}), StateSettings, "state", errors)
    raw_pools = data.get("pools")
    pools: tuple[PoolConfig, ...] = default_pools()
    if raw_pools is not None:
        if not isinstance(raw_pools, list) or not all(isinstance(p, dict) for p in raw_pools):
            errors.append("pools must be an array of tables ([[pools]])")
        else:
            parsed = [_section(p, PoolConfig, f"pools[{i}]", errors, required=("name", "rungs"))
                      for i, p in enumerate(raw_pools)]
            pools = tuple(p for p in parsed if p is not None)
            # `threads` on an in-process INT4 pool: fixed threads, as before [cores] (the same as int4 = N)
            fixed = [p["threads"] for p in raw_pools if p.get("rungs") == ["int4"] and "threads" in p]
            if fixed and cores is not None:
                if "int4" in data.get("cores", {}) and data["cores"]["int4"] != fixed[0]:
                    errors.append(f"the INT4 pool's threads = {fixed[0]} and [cores] int4 = {data['cores']['int4']!r} "
                                  "disagree (keep one: [cores] int4)")
                elif isinstance(fixed[0], int):
                    cores = replace(cores, int4=fixed[0])
    if server is not None:
        _check_server(server, errors)
    if model is not None and not 64 <= model.n_ctx <= 131072:
        errors.append(f"model.n_ctx must be in [64, 131072], got {model.n_ctx}")
    _check_pools(pools, errors)
    if cores is not None:
        _check_cores(cores, errors)
    if errors:
        raise ConfigError(f"{where}: {len(errors)} mistake(s):\n  " + "\n  ".join(errors))
    assert server is not None and model is not None and breaker is not None and quarantine is not None
    assert cores is not None and state is not None
    return Topology(server, model, pools, breaker, quarantine, cores, state)


def _section(raw: object, cls: type, name: str, errors: list[str], required: tuple[str, ...] = ()) -> Any:
    """Build dataclass `cls` from a TOML table, type-checking each field against its default."""
    if not isinstance(raw, dict):
        errors.append(f"[{name}] must be a table")
        return None
    names = {f.name: f for f in fields(cls)}
    bad = False
    for key in sorted(set(raw) - set(names)):
        why = RETIRED.get(name, {}).get(key)
        errors.append(f"{name}: {key!r} was retired ({why})" if why else
                      f"{name}: unknown key {key!r} (known: {', '.join(names)})")
        bad = True
    for key in required:
        if key not in raw:
            errors.append(f"{name}: {key!r} is required")
            bad = True
    values: dict[str, Any] = {}
    for key, value in raw.items():
        f = names.get(key)
        if f is None:
            continue
        want = str(f.type)
        ok = _type_ok(value, want)
        if not ok:
            errors.append(f"{name}.{key}: expected {want}, got {type(value).__name__} {value!r}")
            bad = True
            continue
        number = want in ("float", "float | None")
        values[key] = tuple(value) if isinstance(value, list) else (float(value) if number else value)
    if bad:
        return None
    try:
        return cls(**values)
    except ConfigError as exc:
        errors.append(f"[{name}]: {exc}")
    except TypeError as exc:
        errors.append(f"[{name}]: {exc}")
    return None


def _type_ok(value: object, want: str) -> bool:
    if want == "bool":
        return isinstance(value, bool)
    if want == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if want in ("float", "float | None"):  # (TOML has no null: None is the key left out)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want == "str":
        return isinstance(value, str)
    if want == "str | None":
        return isinstance(value, str)
    if want == "str | int":
        return isinstance(value, str | int) and not isinstance(value, bool)
    if want == "tuple[str, ...]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return True


# Keys of earlier versions, refused with what took their place.
RETIRED = {
    "server": {k: "the drift windows and the draft check's modes are retired: the default decode mode is fast "
                  "(INT4's tokens under the step guard; a flagged input's first tokens scored where a rung above "
                  "can), full precision on the path is precision = \"verified\"" for k in
               ("draft_check", "drift_window", "drift_bound")},
}


def _check_server(s: ServerSettings, errors: list[str]) -> None:
    from qladder.health.guard import GUARD_PRESETS
    from qladder.sanitize import PRESETS

    if not s.model_name.strip():
        errors.append("server.model_name must not be empty")
    if s.max_body_bytes < 1024:
        errors.append(f"server.max_body_bytes must be >= 1024, got {s.max_body_bytes}")
    if s.default_max_tokens < 1:
        errors.append(f"server.default_max_tokens must be >= 1, got {s.default_max_tokens}")
    if s.drain_timeout_s < 0:
        errors.append(f"server.drain_timeout_s must be >= 0, got {s.drain_timeout_s}")
    if s.guard not in GUARD_PRESETS:
        errors.append(f"server.guard: unknown preset {s.guard!r} (choose from {', '.join(GUARD_PRESETS)})")
    if s.sanitize not in PRESETS:
        errors.append(f"server.sanitize: unknown preset {s.sanitize!r} (choose from {', '.join(PRESETS)})")


def _check_cores(c: CoresSettings, errors: list[str]) -> None:
    if c.total < 0:
        errors.append(f"cores.total must be >= 0 (0: the CPUs this process may run on), got {c.total}")
    if not (c.int4 == "elastic" or (isinstance(c.int4, int) and c.int4 >= 1)):
        errors.append(f"cores.int4 must be \"elastic\" or a thread count >= 1, got {c.int4!r}")
    if not c.linger_s >= 0:
        errors.append(f"cores.linger_s must be >= 0, got {c.linger_s}")


def _check_pools(pools: tuple[PoolConfig, ...], errors: list[str]) -> None:
    names = [p.name for p in pools]
    for n in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"pools: the name {n!r} is used twice")
    for p in pools:
        where = f"pool {p.name!r}"
        if not p.rungs:
            errors.append(f"{where}: rungs must not be empty")
            continue
        for r in p.rungs:
            if r not in INT4_RUNGS + MIDDLE_RUNGS + FULL_RUNGS:
                errors.append(f"{where}: unknown rung {r!r} "
                              f"(choose from {', '.join(INT4_RUNGS + MIDDLE_RUNGS + FULL_RUNGS)})")
        remote = [r for r in p.rungs if r in REMOTE_RUNGS]
        if p.url is not None and p.urls:
            errors.append(f"{where}: give url (one server) or urls (replicas), not both")
        urls = p.urls or ((p.url,) if p.url is not None else ())
        if remote and (not urls or not all(u.startswith(("http://", "https://")) for u in urls)):
            errors.append(f"{where}: a {remote[0]} rung needs url = \"http://host:port\" (or urls = [...], replicas)")
        if len(set(urls)) < len(urls):
            errors.append(f"{where}: urls lists a server twice")
        if len(remote) > 1:
            errors.append(f"{where}: one remote rung a pool (its url), got {', '.join(remote)}")
        if urls and not remote:
            errors.append(f"{where}: url and urls are for a remote rung (rungs = [\"llama-server\"] or [\"vllm\"])")
        if p.kind == "int4" and len(p.rungs) > 1:
            errors.append(f"{where}: an INT4 pool has one rung; put full-precision rungs in the pool it hands off to")
        if p.kind == "standby" and any(r in INT4_RUNGS for r in p.rungs):
            errors.append(f"{where}: a standby pool holds full-precision rungs (and int8 under them), not int4")
        middle_misplaced = any(r in MIDDLE_RUNGS for r in p.rungs[1:])
        if middle_misplaced or (p.rungs[0] in MIDDLE_RUNGS and any(r in REMOTE_RUNGS for r in p.rungs)):
            errors.append(f"{where}: int8 is a standby's first rung, under in-process full-precision ones "
                          "(rungs = [\"int8\", \"fp32\"])")
        if p.threads < 1 or p.slots < 1 or p.sessions < 1 or p.max_queue < 1:
            errors.append(f"{where}: threads, slots, sessions and max_queue must be >= 1")
        if not p.weight >= 0.0:
            errors.append(f"{where}: weight must be >= 0, got {p.weight}")
        if p.handoff_to is not None and p.handoff_to not in names:
            errors.append(f"{where}: handoff_to names no pool ({p.handoff_to!r}; pools: {', '.join(names)})")
        if p.handoff_to == p.name:
            errors.append(f"{where}: a pool cannot catch its own handoffs")
        if p.prompt_cache_mb < 0:
            errors.append(f"{where}: prompt_cache_mb must be >= 0, got {p.prompt_cache_mb}")
        if not 0.0 <= p.audit_spare_rate <= 1.0:
            errors.append(f"{where}: audit_spare_rate must be in [0, 1], got {p.audit_spare_rate}")
        if not 0.0 <= p.audit_budget <= 1.0:
            errors.append(f"{where}: audit_budget must be in [0, 1], got {p.audit_budget}")
        if p.audit_rate is None:
            pass
        elif not 0.0 <= p.audit_rate <= 1.0:
            errors.append(f"{where}: audit_rate must be in [0, 1], got {p.audit_rate}")
        elif p.audit_rate > 0 and p.kind != "int4":
            errors.append(f"{where}: audit_rate is an INT4 pool's (its answers are re-scored)")
        elif p.audit_rate > 0 and not any((q.name == p.handoff_to if p.handoff_to else q.kind == "standby")
                                          and any(r in FULL_RUNGS for r in q.rungs) for q in pools):
            errors.append(f"{where}: audit_rate needs a standby to hand off to with a full-precision rung (its "
                          "first scores the answers)")
        if p.precision not in PRECISIONS:
            errors.append(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {p.precision!r}")
        elif p.precision == "verified" and p.kind != "int4":
            errors.append(f"{where}: precision = \"verified\" is an INT4 pool's (its drafts are verified)")
        elif p.precision == "verified" and not any(
                q.name == p.handoff_to and q.rungs
                and (q.rungs[0] == "vllm" if remote else q.rungs[0] in FULL_RUNGS and q.rungs[0] not in REMOTE_RUNGS)
                for q in pools):
            errors.append(f"{where}: precision = \"verified\" needs a standby pool to hand off to whose first rung "
                          "verifies: in-process under an in-process int4 rung, vllm under llama-server")
    int4 = [p for p in pools if p.kind == "int4"]
    standby = [p for p in pools if p.kind == "standby"]
    if len(int4) != 1:
        errors.append(f"pools: in-process serving takes exactly one INT4 pool, got {len(int4)}")
    if len(standby) > 1:
        errors.append(f"pools: in-process serving takes at most one standby pool, got {len(standby)}")
    if int4 and standby and int4[0].handoff_to not in (None, standby[0].name):
        errors.append(f"pool {int4[0].name!r}: handoff_to must be the standby pool {standby[0].name!r}")
    if int4 and standby and int4[0].handoff_to is None:
        errors.append(f"pool {int4[0].name!r}: handoff_to is missing: name the standby pool {standby[0].name!r} "
                      "(or remove the standby pool to serve INT4 alone, with the fallback answer as the last rung)")
    if pools and sum(p.weight for p in pools if p.weight >= 0) <= 0:
        errors.append("pools: at least one pool needs a weight > 0 for new requests")
