"""One request's raw outcome: the line every run writes to `outcomes.jsonl`.

`qladder validate`, `qladder validate --remote`, `qladder bench serving` and `qladder bench serve`
write one `Outcome` per request they sent, warm-up included (phase "warmup"), with everything a
reader needs to recompute each figure of the run's report (`qladder.validate.recompute`):

    run, config, round, phase       which run, which configuration (bare, bare_aa: the A/A copy of
                                    bare, guarded, raw, llama-server, ...), which round, which phase
    prompt_id, prompt_class, split  the corpus prompt, its class, its half (train | test)
    population                      normal | abnormal
    prompt                          the text the engine was given, after sanitizing (bare: the
                                    text as sent); a raw-bytes prompt is rendered with backslashes
    fault, fault_set                the fault model (None for none) and its set (train | test)
    status                          "ok", "error" (a 5xx: an engine error, a crash), "timeout",
                                    "rejected" (a 4xx) or an HTTP status code
    latency_ms, ttft_ms             end to end, and to the first text the client received
    token_ids, token_ids_source     the answer's ids as the engine or server gave them ("engine",
                                    "server"); "retokenized" where a server returned none
    text, finish_reason, fallback   the answer (whole), how it ended, whether it is the fallback
    rungs, hazards, handoff_ms      the rung of each token, the checks that fired, each handoff
    fp32_reference_ids              fp32 alone, greedy, on the same prompt ids (None: not computed);
                                    `identical` (garbage.same_answer) is recomputed from them
    fp32_identical                  what the harness found (the same comparison); older runs, which
                                    kept no reference ids, have only this
    fp32_nll, score_failed          the judge's raw score: the answer's mean negative log-likelihood
                                    under fp32 (None: not scored), and whether scoring was asked
                                    for and failed; the verdict is set again from them
                                    (calibration.rejudge), never read back
    fp32_continuation_identical     the answer after its rung-0 prefix equals fp32's greedy
                                    continuation of that prefix (faulted greedy requests)
    verdict                         the judge's (garbage.Verdict.to_dict), for reading
    stopped (derived)               the guard ended the answer (finish "repetition" or "degraded")
                                    with fewer tokens than fp32's reference, or with no reference to
                                    show it was whole: counted against the guard like garbage
    concurrency, window, start_s,   load benchmarks: the closed-loop window of the request (its
    end_s, step_ms,                 tok/s = the window's tokens over its span), token intervals, and
    completion_tokens               the answer's length as the server counted it (EOS left out)
    verify_windows, verify_drafts,  verified decoding: the windows the verifying rung decided, the
    verify_kept                     INT4 drafts in them, and the drafts that stood
    migrations                      pools of replicas: how many times the answer's stream went on
                                    at a sibling replica after its own died (None: not reported)
    level, kl_top5                  `qladder sweep`: the quantization level (Q4_0, ...) that answered,
                                    and the audit's KL estimate over its top 5 (qladder.audit.score)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qladder.types import FALLBACK_TEXT
from qladder.validate.garbage import GUARD_ENDED, Verdict, judge, same_answer

OK_STATUSES = ("ok", 200)


@dataclass
class Outcome:
    run: str
    config: str
    prompt_id: str
    prompt_class: str
    population: str  # normal | abnormal
    fault: str | None = None
    status: str | int = "ok"
    round: int = 0
    phase: str = "normal"  # warmup | normal | abnormal | faulted
    split: str | None = None  # train | test
    fault_set: str | None = None  # train | test (None: no fault)
    prompt: str = ""
    prompt_tokens: int = 0
    error: str | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    prefill_ms: float | None = None
    token_ids: list[int] = field(default_factory=list)
    token_ids_source: str = "engine"  # engine | server | retokenized
    text: str = ""
    finish_reason: str | None = None
    fallback: bool = False
    greedy: bool = True
    rungs: list[str] = field(default_factory=list)
    hazards: list[str] = field(default_factory=list)
    handoff_ms: list[float] = field(default_factory=list)
    fp32_reference_ids: list[int] | None = None
    fp32_identical: bool | None = None
    fp32_nll: float | None = None
    score_failed: bool = False
    fp32_continuation_identical: bool | None = None
    fp32_first_divergence: int | None = None  # the precision table's: the first position off fp32's answer
    fp32_top1_agreement: float | None = None  # ... the share of positions where the token is fp32's argmax
    known_correct: bool | None = None  # ... a known-answer question answered right
    verdict: dict[str, Any] = field(default_factory=dict)
    # load benchmarks: the closed-loop window a request ran in, and when (seconds from the run's start)
    concurrency: int | None = None
    window: str | None = None
    start_s: float | None = None
    end_s: float | None = None
    step_ms: list[float] = field(default_factory=list)  # intervals between the answer's tokens
    completion_tokens: int | None = None  # as the server counted them (end-of-sequence left out)
    # verified decoding: windows of drafts decided, drafts in them, drafts that stood
    verify_windows: int | None = None
    verify_drafts: int | None = None
    verify_kept: int | None = None
    migrations: int | None = None  # a pool of replicas: the stream went on at a sibling this many times
    # the sweep (validate/sweep.py): the quantization level that answered, and the audit's KL estimate
    level: str | None = None
    kl_top5: float | None = None

    # -- what the figures need ------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    @property
    def five_xx(self) -> bool:
        """A server error, a dropped connection or a timeout (the client got no answer)."""
        s = self.status
        return s in ("error", "timeout") or (isinstance(s, int) and (s >= 500 or s < 0))

    @property
    def four_xx(self) -> bool:
        s = self.status
        return s == "rejected" or (isinstance(s, int) and 400 <= s < 500)

    @property
    def garbage(self) -> bool:
        return self.ok and not self.fallback and bool(self.verdict.get("garbage"))

    @property
    def stopped(self) -> bool:
        """The guard cut the answer short: it ended it (no rung left to finish it, or a loop it
        would not go on with) before the reference's length, or with no reference to compare."""
        if not self.ok or self.fallback or self.finish_reason not in GUARD_ENDED:
            return False
        ref = self.fp32_reference_ids
        return ref is None or len(self.token_ids) < len(ref)

    @property
    def bad(self) -> bool:
        """Counted against the configuration: garbage or stopped."""
        return self.garbage or self.stopped

    @property
    def identical(self) -> bool | None:
        """fp32 alone gives this answer: recomputed from the reference ids where the run kept them
        (the stored boolean otherwise); a stopped answer never is, short of the whole reference."""
        if self.fp32_reference_ids is not None:
            return same_answer(self.token_ids, self.fp32_reference_ids, finish=self.finish_reason)
        if self.fp32_identical is None:
            return None
        return self.fp32_identical and not self.stopped

    @property
    def score(self) -> float | None:
        return self.fp32_nll

    @property
    def unjudged(self) -> bool:
        return self.ok and not self.fallback and not self.garbage and bool(self.verdict.get("unjudged"))

    @property
    def answered_clean(self) -> bool:
        """An answer, neither garbage nor stopped nor the fallback nor unjudged."""
        return self.ok and not self.fallback and bool(self.verdict) and not self.verdict.get("garbage") \
            and not self.verdict.get("unjudged") and not self.stopped

    @property
    def handed_off(self) -> bool:
        return bool(self.handoff_ms)

    @property
    def tokens(self) -> int:
        """The answer's tokens, as the server counted them where it did (load benchmarks)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_ids)

    @property
    def reasons(self) -> list[str]:
        return list(self.verdict.get("reasons") or []) if self.garbage else []

    @property
    def first_rung_tokens(self) -> int:
        """How many leading tokens came from the rung the answer started on (its accepted prefix
        before the first handoff)."""
        if not self.rungs:
            return 0
        k = 0
        while k < len(self.rungs) and self.rungs[k] == self.rungs[0]:
            k += 1
        return k

    # -- judging ---------------------------------------------------------------------------------
    def judge(self, nll: float | None = None, score_failed: bool = False, threshold: float | None = None) -> None:
        """The judge's verdict on this answer (an empty verdict for a request with no answer), its
        raw score kept beside it. `threshold`: the run's calibrated one (None: the committed)."""
        self.fp32_nll, self.score_failed = nll, score_failed
        if not self.ok:
            self.verdict = {}
            return
        if self.fallback and self.text in (FALLBACK_TEXT, ""):
            self.verdict = Verdict().to_dict()  # its own column: not judged as text
            return
        self.verdict = judge(self.text, self.token_ids, self.prompt, nll, score_failed, threshold).to_dict()

    # -- the file ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Outcome:
        names = {f.name for f in dataclasses.fields(cls)}
        o = cls(**{k: v for k, v in d.items() if k in names})
        if "fp32_nll" not in d and o.verdict:  # a run from before the raw score was kept: its score
            o.fp32_nll = o.verdict.get("nll")  # is the one inside the verdict
            o.score_failed = bool(o.verdict.get("unjudged"))
        return o


def write_jsonl(path: Path, outcomes: Iterable[Outcome]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for o in outcomes:
            fh.write(json.dumps(o.to_dict()) + "\n")  # ASCII escapes: any str, a lone surrogate too


def read_jsonl(path: Path) -> list[Outcome]:
    with open(path, encoding="utf-8") as fh:
        return [Outcome.from_dict(json.loads(line)) for line in fh if line.strip()]
