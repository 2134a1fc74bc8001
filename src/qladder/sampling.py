"""Sampling: greedy, or temperature / top-k / top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qladder.errors import ConfigError
from qladder.types import DEFAULT_MAX_TOKENS, TokenLogprob


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


def token_logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(row.float(), dim=-1)  # (V,)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, idx = torch.topk(lp, k)
        top = tuple((int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(int(token), float(lp[token]), top)


class Sampler:
    """Draws one token id from a (V,) float32 logits row. Never sees a row the guard rejected.

    `coupled` (verified requests): the draw at answer position `p` is the Gumbel-max of the
    row, argmax(row / T + g_p) over the tokens top-k and top-p keep, with the noise g_p drawn
    from a generator seeded by (seed, p) alone. That is a draw from the row's distribution
    (the Gumbel-max trick), and it depends on nothing but the row, the seed and the position:
    the rung that drafts (INT4) and the rung that decides (full precision) draw with the same
    noise, a draft stands when the deciding rung's draw is that token, and the answer is the one
    the deciding rung alone gives for that seed, whatever was drafted, whatever the windows
    were and whichever route the request took (drafting, or the full-precision rung alone).
    The textbook rule (keep the draft with probability min(1, p/q), else draw from the
    normalised (p - q)+) gives the same distribution and accepts a little more often, but what
    it draws depends on q, INT4's row, which llama.cpp does not give bit-identically in every
    batch shape: a seeded answer would change with load."""

    def __init__(self, params: SamplingParams, coupled: bool = False):
        self.params = params
        self.coupled = coupled
        self._gen = torch.Generator().manual_seed(params.seed)

    def scores(self, row: torch.Tensor) -> torch.Tensor:
        """row / temperature, -inf where top-k or top-p drop the token (softmax: the distribution)."""
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
        return x

    def sample(self, row: torch.Tensor, position: int = 0) -> int:
        """The token of answer position `position` (used by a coupled sampler only)."""
        if self.params.greedy:
            return int(row.argmax())
        x = self.scores(row)
        if self.coupled:
            return int((x + gumbel(self.params.seed, position, x.numel())).argmax())
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=self._gen))


def gumbel(seed: int, position: int, n: int) -> torch.Tensor:
    """(n,) standard Gumbel noise, a function of (seed, position) alone."""
    g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63))
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
    return (-torch.log(-torch.log(u))).to(torch.float32)
