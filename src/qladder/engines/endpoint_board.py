"""Endpoint health that gateways share: a replica one gateway ejects is out at every gateway.

    board = EndpointBoard()                                    one per gateway process
    Replicas(endpoints, board=board)                           posts its ejections and rejoins
    StateSync(..., endpoints=board)                            carries them to and from the store

Each piece of news is one endpoint's latest event at one gateway: down (ejected: its server
failed with its /health failing too, or an outlier, with what was left of its cooldown, or the
audit's test found its answers broken: `audit`) or up (it rejoined; `audit`: its audited probes
passed), at a wall-clock time. The store keeps the newest per endpoint URL (last writer by time
wins: a later "up" from any gateway replaces a "down" that a gateway with no traffic meanwhile has
not acted on yet, and gateways' clocks must agree, as for the shared breakers). Each gateway's
replicas apply what they hear that is newer than what they knew, at their next pick (replicas.py,
`_listen`): a peer's "down" ejects the endpoint here too, an outlier for the rest of its cooldown
(counted from the news's time, at most the longest cooldown), never the last healthy replica;
this gateway's own probe of its `/health` brings it back (a plain outage's probe asks at once: a
server this gateway reaches is back within a probe). A peer's "up" is not a rejoin here: a
gateway that cannot reach a server does not send traffic to it on a peer's word.

Threads: the replicas (on the remote pool's loop thread) post and read; the state sync's thread
takes the outbox and delivers what the store holds. Every field is behind `_lock`.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

NEWS_SKEW_S = 60.0  # news stamped further than this past a reader's clock is not believed (a broken clock)


@dataclass(frozen=True)
class EndpointNews:
    url: str
    down: bool
    at: float  # wall-clock time (time.time) of the event at the gateway that saw it
    cooldown_s: float = 0.0  # down as an outlier: its cooldown left at `at` (0: a plain outage)
    audit: bool = False  # the audit's test decided (down: broken weights, not an outage; up: its probes passed)

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def decode(raw: str | bytes) -> EndpointNews | None:
        """None: not a piece of news this version reads (another version's, or damaged)."""
        try:
            d = json.loads(raw)
            n = EndpointNews(str(d["url"]), bool(d["down"]), float(d["at"]), float(d["cooldown_s"]),
                             bool(d.get("audit", False)))
        except (ValueError, TypeError, KeyError):
            return None
        ok = math.isfinite(n.at) and math.isfinite(n.cooldown_s) and n.cooldown_s >= 0
        return n if ok else None


def newest(held: dict[str, EndpointNews], news: Iterable[EndpointNews],
           limit: float = math.inf) -> dict[str, EndpointNews]:
    """`held` with each piece of news that is newer than the one held for its URL (pure: the
    board and the memory store keep records by it; the Redis script by the same rule). `limit`:
    news stamped after it (a broken clock's) is not kept, and held news stamped after it is
    replaced by any news sent."""
    out = dict(held)
    for n in news:
        old = out.get(n.url)
        if n.at <= limit and (old is None or old.at < n.at or old.at > limit):
            out[n.url] = n
    return out


class EndpointBoard:
    """One gateway's outbox of its own endpoint events and the fleet's latest news."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outbox: dict[str, EndpointNews] = {}  # this gateway's events not yet in the store
        self._heard: dict[str, EndpointNews] = {}  # the store's newest per URL, as last delivered
        self._version = 0  # bumped by each delivery that changed `_heard`

    # -- the replicas' side (the remote pool's loop thread) -------------------------------------------
    def post(self, news: EndpointNews) -> None:
        """This gateway's own event (an older unsent one for the same URL is replaced)."""
        with self._lock:
            self._outbox = newest(self._outbox, [news])

    def heard_since(self, version: int) -> tuple[int, list[EndpointNews]]:
        """The fleet's news per URL when it changed since `version` (else none), and the version."""
        with self._lock:
            if version == self._version:
                return version, []
            return self._version, list(self._heard.values())

    # -- the state sync's side ---------------------------------------------------------------------
    def outbox(self) -> list[EndpointNews]:
        with self._lock:
            return list(self._outbox.values())

    def delivered(self, sent: Sequence[EndpointNews], held: Iterable[EndpointNews]) -> None:
        """The store took `sent` (each leaves the outbox unless a newer one was posted meanwhile)
        and holds `held`."""
        with self._lock:
            for n in sent:
                if self._outbox.get(n.url) == n:
                    del self._outbox[n.url]
            heard = newest(self._heard, held)
            if heard != self._heard:
                self._heard = heard
                self._version += 1
