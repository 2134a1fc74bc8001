"""Verified decoding over remote rungs (greedy): llama-server drafts, vLLM decides every token.

The remote pool runs a verified greedy request here while rung 0 (llama-server) and rung 1 (vLLM,
which can score) are both its rungs. Per window:

    drafts = rung 0's next k greedy tokens after the context (one request of k tokens; the
             server's prompt cache keeps the prefix), each judged as any streamed token
             (check_remote): a hazard ends the drafts before it, recorded (a rejected draft)
    verdict = rung 1 on context + drafts, one prefill (VllmRung.verify): per draft, its rank
             there (1: rung 1's own argmax) and that argmax; and its own greedy token after them
    accepted = the drafts while each is rank 1, then rung 1's argmax at the first that is not
             (or its token after the drafts when every one stood)

So every accepted token is rung 1's greedy token on the same context: the answer is vLLM's greedy
answer (up to its own prefill/decode rounding), at one prefill per window. The machine counts
rung 1 as the rung that decides (`decided_by`), as in-process verified decoding does. k doubles
after a window where every draft stood (to K_MAX) and halves after one where one did not (to
K_MIN). Rung 0 unreachable, a draft past the deadline, or no draft standing in NO_PROGRESS windows
in a row: rung 1 writes the rest alone (`MoveTo(1)`: the same answer). Rung 1 failing: the request
ends as rung 1's hazards end, with the fallback (nothing unverified is released). Sampled requests are not drafted
(`ServingEngine` starts them on rung 1: rejection sampling needs both rungs' whole rows, which a
stream does not carry).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Callable
from typing import Protocol

import httpx

from qladder.actions import Continue, Done, Move, MoveTo
from qladder.engines.remote import RemoteAt, RemoteEnd, RemoteResumed, RemoteRung, next_item
from qladder.engines.remote_vllm import VllmRung
from qladder.engines.replicas import Replicas
from qladder.errors import RemoteStreamError, StreamSilentError, server_down
from qladder.health.remote import RemoteToken, check_remote
from qladder.machine import RequestMachine
from qladder.sampling import SamplingParams
from qladder.serving.aborts import AbortRegistry
from qladder.serving.prefills import PrefillLedger
from qladder.types import FinishReason, Hazard

K_FIRST, K_MIN, K_MAX = 8, 2, 32
NO_PROGRESS = 3


class VerifyingPool(Protocol):
    """What verified decoding uses of the remote pool that runs it (serving/remote.py's RemotePool;
    its loop's thread is the only caller)."""

    aborts: AbortRegistry
    rungs: dict[int, RemoteRung]
    health: dict[int, bool]
    prefills: dict[int, PrefillLedger]
    verified: dict[str, int]
    stalls: int
    clock: Callable[[], float]

    @property
    def client(self) -> httpx.AsyncClient: ...
    @property
    def check_timeout_s(self) -> float: ...
    def gap_limit(self, j: int, patient: bool, deadline: float, since: float) -> float: ...
    def unhealthy(self, j: int) -> None: ...


async def run_verified(pool: VerifyingPool, m: RequestMachine) -> Move | None:
    """Decide the request window by window; None when it ended, else where it goes (rung 1)."""
    client = pool.client
    verifier = pool.rungs[1]
    assert isinstance(verifier, VllmRung | Replicas)  # (`verifies`: a rung 1 that scores is vLLM's)
    m.decided_by(1, None)
    m.hold(0)
    k, stuck = K_FIRST, 0
    cached = 0  # the context's prefix llama-server holds from the last window (its prompt cache)
    while True:
        if pool.aborts.is_aborted(m.request_id):
            m.finish(FinishReason.ABORT)
            return None
        if not pool.health[0] or stuck >= NO_PROGRESS:
            return MoveTo(1, poisoned=False)
        # room for rung 1's own token, in the answer and in both rungs' contexts
        room = min(m.n_ctx[0], m.n_ctx[1]) - len(m.context) - 1
        if room <= 0 < m.params.max_tokens - m.step - 1:  # llama-server's context is full: vLLM goes on alone
            return MoveTo(1, poisoned=False)
        n = min(k, m.params.max_tokens - m.step - 1, room)
        drafts, hazard = await _draft(pool, m, n, len(m.context) - cached) if n > 0 else ([], None)
        if m.done is not None:  # aborted while drafting
            return None
        try:
            verdict = await asyncio.wait_for(verifier.verify(client, m.context, drafts), pool.check_timeout_s)
        except (RemoteStreamError, httpx.HTTPError, TimeoutError) as exc:
            if server_down(exc):
                pool.unhealthy(1)
            return m.on_hazard(Hazard("engine_error", m.rungs[1], m.step, detail=f"vLLM could not verify: {exc!r}"),
                               None)
        if hazard is not None:
            m.decided_by(1, hazard)  # recorded; the draft ended before it
        stood = next((i for i, s in enumerate(verdict.scored) if s.rank != 1), len(drafts))
        cached = len(m.context) + stood  # the next window's context starts with these (and the slot kept them)
        own = verdict.scored[stood].best if stood < len(drafts) else verdict.next.token_id
        lp = verdict.scored[stood].logprob if stood < len(drafts) else verdict.next.logprob
        if (own is None or not 0 <= own < verifier.n_vocab
                or (stood == len(drafts) and (lp is None or not math.isfinite(lp)))):
            return m.on_hazard(Hazard("nonfinite", m.rungs[1], m.step + stood,
                                      detail=f"vLLM's verdict has no finite token to give ({own})"), None)
        m.rec.verified(len(drafts), stood)
        pool.verified["windows"] += 1
        pool.verified["drafted"] += len(drafts)
        pool.verified["stood"] += stood
        for t in [*drafts[:stood], own]:
            action = m.accept_token(t)
            if isinstance(action, Done):
                return None
            if not isinstance(action, Continue):  # no other action comes to a verified request here
                raise AssertionError(f"a verified window got {action!r}")
        if hazard is not None and hazard.check == "deadline":  # rung 0 too slow to draft: vLLM alone
            stuck = NO_PROGRESS
        elif n > 0 and stood == 0:  # rung 0 gave nothing that stood (refused, or failed at once)
            stuck += 1
        elif stood:
            stuck = 0
        k = min(K_MAX, 2 * k) if drafts and stood == len(drafts) else max(K_MIN, k // 2)


async def _draft(pool: VerifyingPool, m: RequestMachine, n: int, new: int) -> tuple[list[int], Hazard | None]:
    """Rung 0's next `n` greedy tokens, judged; a hazard ends them (before the token it names).
    `new`: the context's tokens the server has not cached (what it prefills: the prefill ledger's)."""
    rung, g = pool.rungs[0], m.config.guard
    drafts: list[int] = []
    prompt = pool.prefills[0].sent(new)  # the draft's prompt is one the server prefills; its gaps are owed others'
    last = pool.clock()
    stream = rung.stream(pool.client, m.context, SamplingParams(max_tokens=n), n)
    try:
        async with contextlib.aclosing(stream) as items:
            while len(drafts) < n:
                if pool.aborts.is_aborted(m.request_id):
                    m.finish(FinishReason.ABORT)
                    return drafts, None
                try:
                    item = await next_item(items, functools.partial(pool.gap_limit, 0, prompt.waiting,
                                                                    g.step_deadline_s, last))
                except StreamSilentError as exc:
                    pool.stalls += 1
                    return drafts, Hazard("deadline", rung.name, m.step + len(drafts), pool.clock() - last,
                                          exc.limit, detail=f"{rung.name} sent no draft token within {exc.limit:.1f} s")
                except StopAsyncIteration:
                    return drafts, Hazard("engine_error", rung.name, m.step + len(drafts),
                                          detail=f"{rung.name}'s stream ended without an end")
                if isinstance(item, RemoteEnd):
                    return drafts, None
                if isinstance(item, RemoteAt):  # (which replica drafts: a verified answer is not audited)
                    continue
                if isinstance(item, RemoteResumed):  # a replica died mid-draft: its sibling goes on, after
                    m.rec.migrated()  # its queue and prefill, waited for as a first token's
                    prompt.resent(len(m.context) + len(drafts))
                    last = pool.clock()
                    continue
                assert isinstance(item, RemoteToken)
                prompt.answered()
                last = pool.clock()
                t = item.token_id
                expected = rung.detokenize_bytes([t]) if 0 <= t < rung.n_vocab else None
                hazard = check_remote(m.guard, item, [*m.accepted, *drafts], rung.name, rung.n_vocab, expected)
                if hazard is not None:
                    return drafts, hazard
                drafts.append(t)
    except (RemoteStreamError, httpx.HTTPError) as exc:
        if server_down(exc):
            pool.unhealthy(0)
        return drafts, Hazard("engine_error", rung.name, m.step + len(drafts), detail=f"{rung.name}: {exc!r}")
    finally:
        prompt.close()
    return drafts, None
