"""An ejected replica's probe: an answer of that one llama-server to a real prompt, shown to nobody,
handed to the audit (its trail, as an audited answer's) so that clean scores can bring it back.

It runs on the remote pool's loop (`RemotePool.spawn`), outside the ladder: no step guard, no
handoff, no client. A server that fails the probe has given no evidence; the next request's probe
asks again."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from qladder.audit import AuditTrail
from qladder.client import Request
from qladder.engines.remote import RemoteEnd, RemoteRung
from qladder.errors import QladderError, RemoteStreamError
from qladder.health.remote import RemoteToken

_log = logging.getLogger("qladder.audit")
PROBE_TIMEOUT_S = 120.0


async def probe_answer(rung: RemoteRung, probe: Request, trail: AuditTrail, client: httpx.AsyncClient) -> None:
    """`probe`'s answer from `rung` (one server), each token's top-k kept in `trail`, which hands
    the answer to the audit at its end (EOS is not part of it, as in a served answer)."""
    ids: list[int] = []
    n = probe.params.max_tokens

    async def run() -> None:
        stream = rung.stream(client, list(probe.prompt_ids), probe.params, n)
        async with contextlib.aclosing(stream) as items:
            async for item in items:
                if isinstance(item, RemoteEnd):
                    return
                if isinstance(item, RemoteToken):
                    if item.token_id in rung.eos_ids:
                        return
                    trail.add_top(item.token_id, item.top)
                    ids.append(item.token_id)
                    if len(ids) >= n:
                        return

    try:
        await asyncio.wait_for(run(), PROBE_TIMEOUT_S)
    except (httpx.HTTPError, QladderError, RemoteStreamError, TimeoutError) as exc:
        _log.warning("probe %s of %s failed: %s", probe.request_id, trail.pool, exc)
        return
    trail.done(probe.prompt_ids, ids)
