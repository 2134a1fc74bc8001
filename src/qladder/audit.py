"""The drift audit: how far INT4's answers are from full precision's, measured in production.

A share of the INT4 answers (`audit_rate`, chosen by a hash of the request id) is re-scored by the
full-precision rung in the background, off the request's path: the standby evaluates prompt +
answer in its batched forward (in chunks, in turns it has nothing else to do) and compares, at
every position of the INT4-written part of the answer, INT4's token with its own row:

    agreement          the share of positions where INT4's token is full precision's argmax
                       (top-1 agreement, teacher-forced: each position on INT4's own context)
    first_divergence   the first such position where it is not (None: none in the answer)
    kl_top5            the mean over positions of KL(INT4 || fp32) over INT4's 5 most likely
                       tokens, both distributions renormalised over those 5 (an estimate: the
                       tails are left out; INT4's top 5 are recorded as it decodes)
    fp32_gap           the mean of (fp32's top logprob - fp32's logprob of INT4's token): about 0
                       for a clean greedy answer; the score the endpoint detector reads for
                       greedy answers (health/detector.py)
    excess             the mean of fp32's excess surprise at INT4's token: -log p(token) - H(p),
                       p fp32's distribution there. A sampled token is judged by fp32's probability
                       of it, not by argmax agreement: at or under 0 on average for a clean rung,
                       greedy or sampled (its tokens are ones fp32 finds likely), large where a
                       broken one writes what fp32 would not say. The score the endpoint detector
                       reads for sampled answers

`AuditTrail` is what a request's machine keeps while INT4 decodes (its tokens' top-5 logprobs);
at the end it hands an `AuditJob` to its sink (the standby's queue). `score` is the pure
computation on full precision's rows, `score_top` the same from a remote standby's top-k of them
(vLLM's prompt logprobs: the excess bounded, the rest exact); `DriftWatch` keeps each prompt class's recent agreement
for a router that sends a class whose agreement falls below a bound to verified decoding.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from qladder.health.detector import answer_score

TOP_K = 5


def top_k(row: torch.Tensor) -> tuple[tuple[int, float], ...]:
    """A row's TOP_K most likely tokens, as (id, logprob)."""
    vals, idx = torch.topk(torch.log_softmax(row.float(), dim=-1), TOP_K)
    return tuple(zip(idx.tolist(), vals.tolist(), strict=True))


def selected(request_id: str, rate: float) -> bool:
    """Whether a request is audited: a hash of its id under the rate (reproducible, uncorrelated
    with arrival order)."""
    if rate <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h / 2**64 < rate


@dataclass(frozen=True)
class AuditJob:
    request_id: str
    prompt_class: str
    pool: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # the INT4-written part of the answer
    top: tuple[tuple[tuple[int, float], ...], ...]  # INT4's top-5 (id, logprob) at each of them (() light)
    greedy: bool = True  # the answer was decoded greedily (its agreement with fp32's argmax means something)
    urgent: bool = False  # its endpoint's test has not decided, or a probe: scored before the others
    probe: bool = False  # an ejected endpoint's probe answer (nobody was shown it): what can bring it back


@dataclass
class AuditRecord:
    request_id: str
    prompt_class: str
    pool: str
    tokens: int
    agreement: float
    first_divergence: int | None
    kl_top5: float
    fp32_gap: float
    ts: float = field(default_factory=time.time)
    source: str = "audit"  # what chose the answer for scoring ("audit": the sampled share)
    excess: float | None = None  # mean excess surprise (None: a record from before it was kept)
    greedy: bool = True  # a greedy answer's (a sampled one's agreement is the sampler's, not INT4's drift)
    key: str = ""  # what it is evidence of (answer_key): the same answer audited twice is one piece of evidence

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def score(self) -> float | None:
        """What the endpoint detector reads (health/detector.py, by mode): a greedy answer's fp32_gap,
        a sampled one's excess (None: a record from before it was kept)."""
        return answer_score(self.greedy, self.fp32_gap, self.excess)


class AuditTrail:
    """One INT4 answer's record for the audit, kept by its machine: its tokens' top-5 logprobs
    when it was chosen (the audit's share) or its endpoint was under test at its start; a light
    one (nothing kept per token, no KL estimate) for any other, audited only if it turns urgent."""

    def __init__(self, request_id: str, prompt_class: str, pool: str, sink: Callable[[AuditJob], None],
                 greedy: bool = True, urgent: bool | Callable[[str], bool] = False, chosen: bool = True,
                 probe: bool = False):
        """urgent: whether the job goes first, or a callable asked at the answer's end with its
        endpoint (a pool of replicas: the one that wrote it, known only then). chosen: the answer
        was picked for the audit; one that was not keeps a light trail and is audited only if
        urgent (its endpoint suspect at its end, or a hazard of its own: `done(suspicious=True)`).
        probe: an ejected endpoint's probe answer (always chosen and urgent)."""
        self.request_id, self.prompt_class, self.pool, self.sink = request_id, prompt_class, pool, sink
        self.greedy, self.urgent, self.chosen, self.probe = greedy, urgent or probe, chosen or probe, probe
        self.mixed = False
        self.sent = False  # handed to the sink (once: at a hazard, or at the end)
        self.tokens = 0  # INT4 tokens accepted so far
        self.top: list[tuple[tuple[int, float], ...]] = []

    def add(self, row: torch.Tensor) -> None:
        """A row INT4 gave and the machine accepted a token from (called before the token joins)."""
        self.tokens += 1
        if self.chosen:
            self.top.append(top_k(row))

    def add_top(self, token_id: int, top: Sequence[tuple[int, float | None]]) -> None:
        """A remote INT4 token the pool accepted, with the top-k its server streamed (llama-server:
        n_probs of them): the finite ones, padded to TOP_K with zero-probability entries (the KL
        estimate is then over the server's top-k; the endpoint test reads fp32's alone)."""
        self.tokens += 1
        if self.chosen:
            kept = [(int(t), float(v)) for t, v in top[:TOP_K] if v is not None and math.isfinite(v)] \
                or [(token_id, 0.0)]
            self.top.append((*kept, *[(kept[0][0], -math.inf)] * (TOP_K - len(kept))))

    def at(self, endpoint: str) -> None:
        """Which endpoint writes the tokens that follow (a pool of replicas says, before each
        one's first token): the answer is that endpoint's; an answer written by two (a stream
        continued at a sibling) is nobody's evidence and is not audited."""
        if not self.tokens:
            self.pool = endpoint
        elif endpoint != self.pool:
            self.mixed = True

    def done(self, prompt_ids: Sequence[int], answer_ids: Sequence[int], suspicious: bool = False) -> None:
        """INT4's part of the answer is written (the answer ended, or left INT4 on a hazard:
        `suspicious`, in-band evidence that makes the job urgent): hand it to the sink, once
        (nothing to audit: nothing written, written by two endpoints, or neither chosen nor urgent)."""
        if self.sent:
            return
        n = min(self.tokens, len(answer_ids))
        if not n or self.mixed:
            return
        urgent = suspicious or (self.urgent(self.pool) if callable(self.urgent) else self.urgent)
        if urgent or self.chosen:
            self.sent = True
            self.sink(AuditJob(self.request_id, self.prompt_class, self.pool, tuple(prompt_ids),
                               tuple(answer_ids[:n]), tuple(self.top[:n]) if self.chosen else (), self.greedy,
                               urgent, self.probe))


def answer_key(prompt_ids: Sequence[int], answer_ids: Sequence[int], greedy: bool = True) -> str:
    """A digest of what an audited answer is evidence of: a greedy answer is its prompt's (the
    same request sent again, or with another max_tokens, writes the same tokens: one piece of
    evidence, not several), a sampled one is its prompt's and its own tokens'."""
    h = hashlib.blake2b(digest_size=8)
    h.update(len(prompt_ids).to_bytes(4, "little"))
    for ids in (prompt_ids, () if greedy else answer_ids):
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids))
    return h.hexdigest()


def score(job: AuditJob, rows: torch.Tensor) -> AuditRecord:
    """Full precision's rows at the answer's positions ((n, V): row i predicts answer token i);
    the record's source says what chose the answer ("probe" for a probe's, else "audit")."""
    n = len(job.answer_ids)
    logp = torch.log_softmax(rows[:n].float(), dim=-1)
    tokens = torch.tensor(job.answer_ids)
    best = logp.argmax(dim=-1)
    agree = best == tokens
    wrong = (~agree).nonzero().flatten()
    own = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    gap = logp.gather(1, best.unsqueeze(1)).squeeze(1) - own
    entropy = -torch.special.xlogy(logp.exp(), logp.exp()).sum(dim=-1)
    if job.top:  # (a light trail's job has no INT4 top-5: no KL estimate)
        ids = torch.tensor([[t for t, _ in top] for top in job.top])  # (n, 5)
        q = torch.softmax(torch.tensor([[v for _, v in top] for top in job.top]), dim=-1)
        p = torch.softmax(logp.gather(1, ids), dim=-1)
        kl = (q * (q.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum(dim=-1)
    else:
        kl = torch.tensor([math.nan])
    return AuditRecord(job.request_id, job.prompt_class, job.pool, n, float(agree.float().mean()),
                       int(wrong[0]) if len(wrong) else None, float(kl.mean()), float(gap.mean()),
                       source="probe" if job.probe else "audit", excess=float((-own - entropy).mean()),
                       greedy=job.greedy, key=answer_key(job.prompt_ids, job.answer_ids, job.greedy))


class TopRow(NamedTuple):
    """Full precision's row at one answer position as a remote server reports it (vLLM's
    `prompt_logprobs`): the answer token's logprob and rank (1: fp32's argmax) and the `k` most
    likely tokens, as (id, logprob), most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def score_top(job: AuditJob, rows: Sequence[TopRow], n_vocab: int) -> AuditRecord:
    """`score` from the top k of full precision's rows instead of the whole rows (a remote
    standby: vLLM's prompt logprobs). Agreement, first divergence and fp32_gap read the token's
    rank and logprob and fp32's top one: exact. The entropy under `excess` is bounded above: the
    known entries (the top k, and the token where it is outside them) as they are, the tail's
    mass spread evenly over the rest of the vocabulary (the most entropy a tail of that mass can
    have, each of its tokens under the k-th), so the excess is at or under the exact one, and a
    detector calibrated on exact scores keeps its false-alarm rate (at some cost in power). The
    KL estimate gives a token of INT4's top 5 that fp32's top k lacks that even share of the tail."""
    n = len(job.answer_ids)
    if len(rows) < n:
        raise ValueError(f"{len(rows)} rows for an answer of {n} tokens")
    agree, gaps, excess, kls = [], [], [], []
    for i, (token, row) in enumerate(zip(job.answer_ids, rows, strict=False)):
        known = dict(row.top)
        known.setdefault(int(token), row.logprob)
        probs = [math.exp(v) for v in known.values() if math.isfinite(v)]
        tail_mass = max(0.0, 1.0 - sum(probs))
        tail_n = max(1, n_vocab - len(known))
        tail_lp = math.log(tail_mass / tail_n) if tail_mass > 0 else -math.inf
        entropy = -sum(p * math.log(p) for p in probs if p > 0) \
            + (tail_mass * (math.log(tail_n) - math.log(tail_mass)) if tail_mass > 0 else 0.0)
        agree.append(row.rank == 1)
        gaps.append(max(0.0, row.top[0][1] - row.logprob) if row.top else 0.0)
        excess.append(-row.logprob - entropy)
        if job.top:
            ids = [t for t, _ in job.top[i]]
            q = torch.softmax(torch.tensor([v for _, v in job.top[i]]), dim=-1)
            p = torch.softmax(torch.tensor([known.get(t, tail_lp) for t in ids]), dim=-1)
            kls.append(float((q * (q.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum()))
    wrong = [i for i, a in enumerate(agree) if not a]
    return AuditRecord(job.request_id, job.prompt_class, job.pool, n, sum(agree) / n if n else 1.0,
                       wrong[0] if wrong else None, sum(kls) / len(kls) if kls else math.nan,
                       sum(gaps) / n if n else 0.0, source="probe" if job.probe else "audit",
                       excess=sum(excess) / n if n else 0.0, greedy=job.greedy,
                       key=answer_key(job.prompt_ids, job.answer_ids, job.greedy))


def calibrate_drift_bound(clean: dict[str, Sequence[tuple[int, float]]], min_answers: int = 20,
                          false_verify: float = 1e-3, runs: int = 20_000, seed: int = 20261206) -> dict[str, Any]:
    """DriftWatch's bound from clean greedy answers' (tokens, agreement) by prompt class (the train
    half's): for each class, the `false_verify` quantile of the token-weighted agreement of
    `min_answers` answers drawn with replacement (the fewest DriftWatch judges, where a clean
    class strays furthest); the bound is the lowest of them, so a clean class of any of these
    kinds falls under it at its first judgement with at most that chance."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per: dict[str, dict[str, float | int]] = {}
    for cls, answers in sorted(clean.items()):
        if len(answers) < 3:
            continue
        n = np.array([t for t, _ in answers], dtype=np.float64)
        a = np.array([x for _, x in answers], dtype=np.float64)
        draw = rng.integers(0, len(a), (runs, min_answers))
        means = (n[draw] * a[draw]).sum(axis=1) / n[draw].sum(axis=1)
        per[cls] = {"answers": len(a), "agreement": float((n * a).sum() / n.sum()),
                    "quantile": float(np.quantile(means, false_verify))}
    if not per:
        raise ValueError("calibrating the drift bound needs a class with >= 3 clean greedy answers")
    return {"bound": min(float(v["quantile"]) for v in per.values()), "false_verify": false_verify,
            "min_answers": min_answers, "classes": per}


class DriftWatch:
    """Each prompt class's agreement over its last `window` audited greedy answers
    (token-weighted; a sampled answer's disagreement with fp32's argmax is the sampler's, and its
    drift is the endpoint test's to see, through its excess); a class below `bound` (with at least
    `min_answers` of them) is to be served verified. Any thread may record and ask (one lock)."""

    def __init__(self, bound: float = 0.0, window: int = 200, min_answers: int = 20):
        self.bound, self.window, self.min_answers = bound, window, min_answers
        self._recent: dict[str, deque[tuple[int, float]]] = {}
        self._lock = threading.Lock()

    def record(self, r: AuditRecord) -> None:
        if not r.greedy:
            return
        with self._lock:
            self._recent.setdefault(r.prompt_class, deque(maxlen=self.window)).append((r.tokens, r.agreement))

    def agreement(self, prompt_class: str) -> float | None:
        with self._lock:
            recent = list(self._recent.get(prompt_class, ()))
        tokens = sum(n for n, _ in recent)
        return sum(n * a for n, a in recent) / tokens if tokens else None

    def verify(self, prompt_class: str) -> bool:
        """Whether requests of this class should be verified now."""
        with self._lock:
            enough = len(self._recent.get(prompt_class, ())) >= self.min_answers
        a = self.agreement(prompt_class)
        return enough and a is not None and a < self.bound
