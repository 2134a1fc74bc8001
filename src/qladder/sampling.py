"""Sampling: greedy, or temperature / top-k / top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qladder.errors import ConfigError
from qladder.types import DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always decode max_tokens
    logprobs: int | None = None  # None: off; k >= 0: each token's log-probability and its top k alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ConfigError(f"logprobs (top alternatives) must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the rung that produced it (the raw logits row,
    before temperature and top-p), and the `k` most likely alternatives as (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(row.float(), dim=-1)  # (V,)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, idx = torch.topk(lp, k)
        top = tuple((int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(int(token), float(lp[token]), top)


@dataclass(frozen=True)
class Draft:
    """A token another rung drafted for this position (verified decoding), and for a sampled
    request the distribution it was drawn from (`Sampler.probs` of the drafting rung's row)."""

    token: int
    q: torch.Tensor | None = None  # (V,) probabilities; None for a greedy request


class Sampler:
    """Draws one token id from a (V,) float32 logits row. Never sees a row the guard rejected."""

    def __init__(self, params: SamplingParams, seed_offset: int = 0):
        self.params = params
        self._gen = torch.Generator().manual_seed(params.seed + seed_offset)

    def probs(self, row: torch.Tensor) -> torch.Tensor:
        """The distribution a sampled request draws from: temperature, then top-k, then top-p."""
        p = self.params
        x = row / p.temperature  # (V,)
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # keep the first token always
            x = x.scatter(0, idx[drop], float("-inf"))
        return torch.softmax(x, dim=-1)

    def sample(self, row: torch.Tensor) -> int:
        if self.params.greedy:
            return int(row.argmax())
        return self.draw(self.probs(row))

    def draw(self, probs: torch.Tensor) -> int:
        """One id from a distribution (`probs`), with this sampler's generator."""
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def verify(self, row: torch.Tensor, draft: Draft) -> int:
        """The token this row gives when `draft` was proposed for it: greedy, the row's own argmax
        (the draft stands when it is that token); sampled, speculative sampling's rule (Leviathan
        et al. 2023; Chen et al. 2023): keep the draft with probability min(1, p/q), else draw
        from the normalised (p - q)+, so the token is distributed as p, this row's own."""
        if self.params.greedy or draft.q is None:
            return int(row.argmax())
        p, q, d = self.probs(row), draft.q, draft.token
        u = float(torch.rand((), generator=self._gen))
        if float(q[d]) > 0.0 and u * float(q[d]) < float(p[d]):
            return d
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        if not total > 0.0:  # p == q up to rounding: the draft's rejection had probability ~0
            residual, total = p, 1.0
        return int(torch.multinomial(residual / total, 1, generator=self._gen))
