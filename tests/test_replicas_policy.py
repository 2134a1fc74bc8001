"""Replicas' policy on fake endpoints (engines/replicas.py): whose failure a failed call is, where
a stream goes on, how many times, and one probe per ejected endpoint. Fakes, not mocks: each
endpoint is a tiny deterministic "model" (the next id is the sum of the context mod 97) that can
die mid-stream, answer a 5xx, or stay up; the real servers' kill -9 is in test_replicas.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import httpx
import pytest

from qladder.engines.remote import RemoteAt, RemoteEnd, RemoteResumed
from qladder.engines.remote_vllm import Verdict
from qladder.engines.replicas import OUTLIER_COOLDOWN_S, OUTLIER_FAILS, Replicas
from qladder.errors import EndpointsDownError, RemoteStreamError, RemoteTransportError
from qladder.health.remote import RemoteToken, Scored
from qladder.sampling import SamplingParams

from .fakes import Clock


def next_id(ids: list[int]) -> int:
    return sum(ids) % 97


class FakeEndpoint:
    """One replica: `fail_after` tokens into its next stream it fails (a 5xx or a cut-short
    stream: RemoteTransportError); `up` is what its /health answers."""

    name, can_score, precision, fingerprint = "fake", True, "int4", "v1"
    n_ctx, n_slots, n_vocab, eos_ids, server = 4096, 1, 97, frozenset[int](), "fake-server"

    def __init__(self, url: str, fail_after: int | None = None, up: bool = True, broken_after: int | None = None):
        self.base_url, self.fail_after, self.up = url, fail_after, up
        self.broken_after = broken_after  # every stream fails this many tokens in (a broken server)
        self.streams = self.calls = self.health_checks = 0
        self.revives: FakeEndpoint | None = None

    async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                     n: int) -> AsyncGenerator[RemoteToken | RemoteEnd, None]:
        self.streams += 1
        if self.revives is not None:
            self.revives.up = True
            await asyncio.sleep(0.2)  # (its probe runs every 0.01 s)
        ctx = list(ids)
        for i in range(n):
            if self.fail_after is not None and i >= self.fail_after:
                self.fail_after = None  # (one failure a stream)
                raise RemoteTransportError(f"{self.base_url}: stream cut short")
            if self.broken_after is not None and i >= self.broken_after:
                raise RemoteTransportError(f"{self.base_url} answered HTTP 500")
            t = next_id(ctx)
            ctx.append(t)
            yield RemoteToken(t, -0.1, None)
            await asyncio.sleep(0)
        yield RemoteEnd(length=True)

    async def alive(self, client: httpx.AsyncClient) -> bool:
        self.health_checks += 1
        return self.up

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        self.calls += 1
        if self.broken_after is not None:
            raise RemoteTransportError(f"{self.base_url} answered HTTP 500")
        if self.fail_after is not None:
            self.fail_after = None
            raise RemoteTransportError(f"{self.base_url} answered HTTP 500")
        return [Scored(-0.1, 1, t) for t in draft]

    def close(self) -> None:
        pass


def replicas(*endpoints: FakeEndpoint) -> Replicas:
    return Replicas(list(endpoints), probe_every_s=0.01)  # type: ignore[arg-type]


async def collect(r: Replicas, n: int) -> list[object]:
    async with httpx.AsyncClient() as client:
        return [item async for item in r.stream(client, [1, 2, 3], SamplingParams(max_tokens=n), n)]


def tokens(items: list[object]) -> list[int]:
    return [i.token_id for i in items if isinstance(i, RemoteToken)]


def unbroken(n: int) -> list[int]:
    ctx = [1, 2, 3]
    for _ in range(n):
        ctx.append(next_id(ctx))
    return ctx[3:]


def test_a_dead_server_mid_stream_is_ejected_and_the_answer_goes_on_at_a_sibling():
    dead = FakeEndpoint("http://a", fail_after=5, up=False)
    r = replicas(dead, FakeEndpoint("http://b"))
    items = asyncio.run(collect(r, 12))
    assert tokens(items) == unbroken(12)  # the sibling continued from the ids yielded
    assert sum(isinstance(i, RemoteResumed) for i in items) == 1 and isinstance(items[-1], RemoteEnd)
    assert (r.healthy, r.migrations, r.ejections, r.inflight) == ([False, True], 1, 1, [0, 0])


def test_a_5xx_from_a_server_that_answers_health_goes_on_at_a_sibling_and_fails_if_it_fails_there_too():
    """A server that fails a request and still answers /health: the request goes on once at a
    sibling. The sibling answers: one stream, no ejection (one failure blames, it does not eject).
    The sibling fails it too: the request's input did, and its error reaches the pool."""
    live, other = FakeEndpoint("http://a", fail_after=3, up=True), FakeEndpoint("http://b")
    r = replicas(live, other)
    items = asyncio.run(collect(r, 12))
    assert tokens(items) == unbroken(12) and sum(isinstance(i, RemoteResumed) for i in items) == 1
    assert (r.healthy, r.migrations, r.ejections, other.streams) == ([True, True], 1, 0, 1)
    both = replicas(FakeEndpoint("http://a", fail_after=3), FakeEndpoint("http://b", fail_after=1))
    with pytest.raises(RemoteStreamError) as err:
        asyncio.run(collect(both, 12))
    assert not isinstance(err.value, RemoteTransportError) and "as did http://a" in str(err.value)
    assert (both.healthy, both.ejections) == ([True, True], 0)
    alone = replicas(FakeEndpoint("http://a", fail_after=3))  # no sibling to ask: the request's, as for one server
    with pytest.raises(RemoteStreamError):
        asyncio.run(collect(alone, 12))
    assert alone.healthy == [True]


def test_every_replica_failing_is_endpoints_down_whatever_the_last_failure_was():
    """The last replica's stream cut short (not a refused connection) still says the rung is down:
    the pool marks it unhealthy and probes it (EndpointsDownError)."""
    r = replicas(FakeEndpoint("http://a", fail_after=2, up=False), FakeEndpoint("http://b", fail_after=2, up=False))
    with pytest.raises(EndpointsDownError):
        asyncio.run(collect(r, 12))
    assert (r.healthy, r.migrations, r.ejections) == ([False, False], 1, 2)
    with pytest.raises(EndpointsDownError):  # and a new stream is refused at once
        asyncio.run(collect(r, 4))


def test_an_endpoint_ejected_again_has_one_probe_and_rejoins_once():
    async def go() -> Replicas:
        a = FakeEndpoint("http://a", up=False)
        r = replicas(a, FakeEndpoint("http://b"))
        r.eject(0)
        r.eject(0)  # a second failure before the probe saw it back: still one probe
        assert len([p for p in r._probes.values() if not p.done()]) == 1
        async with httpx.AsyncClient() as client:
            await r.alive(client)  # the pool's own probe of the rung races the endpoint's
            a.up = True
            assert await r.alive(client)
            for _ in range(100):
                await asyncio.sleep(0.01)
        assert 0 not in r._probes  # the probe ended, and left the registry (an ejection now starts another)
        return r

    r = asyncio.run(go())
    assert (r.healthy, r.ejections, r.rejoins) == ([True, True], 1, 1)


def test_score_and_verify_go_on_at_a_sibling_when_a_replica_dies():
    async def go(r: Replicas) -> tuple[list[Scored], Verdict | None]:
        async with httpx.AsyncClient() as client:
            scored = await r.score(client, [1, 2], [5, 6])
            try:
                verdict = await r.verify(client, [1, 2], [5])
            except TypeError:  # fakes are not vLLM: verify refuses them by type, after picking one
                verdict = None
            return scored, verdict

    r = replicas(FakeEndpoint("http://a", fail_after=0, up=False), FakeEndpoint("http://b"))
    scored, verdict = asyncio.run(go(r))
    assert [s.rank for s in scored] == [1, 1] and verdict is None
    assert (r.healthy, r.ejections) == ([False, True], 1)



def test_a_stream_that_lost_every_replica_while_one_rejoined_fails_the_request_not_the_rung():
    a = FakeEndpoint("http://a", fail_after=2, up=False)
    b = FakeEndpoint("http://b", fail_after=4, up=False)
    b.revives = a  # as b's stream starts, a answers its /health again (and its probe sees it)
    r = replicas(a, b)
    with pytest.raises(RemoteTransportError) as err:
        asyncio.run(collect(r, 12))
    assert not isinstance(err.value, EndpointsDownError) and "lost 2 replicas in a row" in str(err.value)
    assert (r.healthy, r.migrations, r.ejections, r.rejoins) == ([True, False], 1, 2, 1)


def test_whose_failure_a_remote_call_was():
    """server_down: a 5xx or a stream cut short is the request's (RemoteStreamError, its
    transport subclass); a refused connection, a timeout or every replica out is the server's."""
    import pickle

    from qladder.errors import StreamSilentError, server_down

    assert not server_down(RemoteStreamError("HTTP 500"))
    assert not server_down(RemoteTransportError("stream ended without [DONE]"))
    assert server_down(EndpointsDownError("every replica is out"))
    assert server_down(httpx.ConnectError("refused"))
    assert server_down(httpx.ReadTimeout("hung"))
    assert server_down(StreamSilentError(2.5))
    again = pickle.loads(pickle.dumps(StreamSilentError(2.5)))
    assert isinstance(again, StreamSilentError) and again.limit == 2.5 and str(again) == "no item within 2.5 s"


def test_a_server_that_fails_every_call_and_answers_its_health_is_ejected_for_a_cooldown():
    """A broken server behind a /health that says 200, one request at a time (it is picked first
    each time): each failed request goes on at the sibling and answers, blaming it; blamed
    OUTLIER_FAILS times in a row it is out, and its /health cannot bring it back before the
    cooldown; ejected again, the cooldown doubles. A call in flight when it was ejected adds no
    second count, and if its sibling dies it comes back at once (better a suspect than none)."""
    clock = Clock()
    bad, good = FakeEndpoint("http://a", broken_after=2), FakeEndpoint("http://b")
    r = Replicas([bad, good], probe_every_s=0.01, clock=clock)  # type: ignore[list-item]

    async def go() -> None:
        for _ in range(OUTLIER_FAILS):
            assert tokens(await collect(r, 6)) == unbroken(6)  # every answer whole, at the sibling
        assert (r.healthy, r.ejections, r.migrations, bad.streams) == ([False, True], 1, OUTLIER_FAILS, OUTLIER_FAILS)
        until = r._out_until[0]
        assert until == clock() + OUTLIER_COOLDOWN_S
        r._blame(0)  # a call that was in flight on it when it was ejected
        assert r._out_until[0] == until
        checks = bad.health_checks
        await asyncio.sleep(0.1)  # ten probe periods inside the cooldown: no /health asked, no rejoin
        assert r.healthy == [False, True] and bad.health_checks == checks
        assert tokens(await collect(r, 6)) == unbroken(6) and bad.streams == OUTLIER_FAILS  # not sent there
        clock.t += OUTLIER_COOLDOWN_S
        for _ in range(100):
            await asyncio.sleep(0.01)
            if r.healthy[0]:
                break
        assert r.healthy == [True, True] and r.rejoins == 1 and r._out_until[0] == 0.0
        for _ in range(OUTLIER_FAILS):  # still broken: out again, for twice as long
            await collect(r, 6)
        assert r.healthy == [False, True] and r._out_until[0] == clock() + 2 * OUTLIER_COOLDOWN_S
        good.up = False
        r.eject(1)  # its sibling dies: the outlier is all there is
        async with httpx.AsyncClient() as client:
            assert await r.alive(client) and r.healthy == [True, False]

    asyncio.run(go())


def test_requests_that_fail_every_replica_eject_none_among_normal_traffic():
    """A request whose input fails every replica (here: a context that starts with 66) fails at
    its sibling too: no replica is blamed, however many such requests come, between normal ones
    and at once with them."""
    class Picky(FakeEndpoint):
        async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                         n: int) -> AsyncGenerator[RemoteToken | RemoteEnd, None]:
            self.streams += 1
            ctx = list(ids)
            for _ in range(n):
                if ids[0] == 66 and len(ctx) >= 5:  # two tokens into the answer, wherever it is
                    raise RemoteTransportError(f"{self.base_url} answered HTTP 500")
                ctx.append(next_id(ctx))
                yield RemoteToken(ctx[-1], -0.1, None)
                await asyncio.sleep(0)
            yield RemoteEnd(length=True)

    r = Replicas([Picky("http://a"), Picky("http://b"), Picky("http://c")], probe_every_s=0.01,  # type: ignore[list-item]
                 clock=Clock())

    async def go() -> list[object]:
        async with httpx.AsyncClient() as client:
            async def one(first: int) -> list[object]:
                return [i async for i in r.stream(client, [first, 2, 3], SamplingParams(max_tokens=4), 4)]

            out: list[object] = []
            for _ in range(4 * OUTLIER_FAILS):
                out += await asyncio.gather(one(1), one(66), one(1), return_exceptions=True)
                out += await asyncio.gather(one(66), return_exceptions=True)
            return out

    results = asyncio.run(go())
    failed = [x for x in results if isinstance(x, BaseException)]
    assert len(failed) == 2 * 4 * OUTLIER_FAILS and all(type(e) is RemoteStreamError for e in failed)
    assert (r.healthy, r.ejections) == ([True, True, True], 0)


def test_at_most_half_the_replicas_are_out_as_outliers():
    clock = Clock()
    r = Replicas([FakeEndpoint(f"http://{c}", broken_after=1) for c in "ab"] + [FakeEndpoint("http://c"),  # type: ignore[list-item]
                 FakeEndpoint("http://d")], probe_every_s=0.01, clock=clock)

    async def go() -> None:  # (an ejection starts its probe on the loop)
        for _ in range(OUTLIER_FAILS):
            for k in (0, 1, 2):
                r._blame(k)
        assert r.healthy == [False, False, True, True]  # the third, blamed as often: two of four are out

    asyncio.run(go())


def test_at_most_half_counts_outliers_whose_cooldown_is_over_and_not_yet_back():
    """Two of four out as outliers, their cooldown over, their /health still down: they are
    still out, so a third replica blamed as often stays in."""
    clock = Clock()
    eps = [FakeEndpoint(f"http://{c}", up=c not in "ab") for c in "abcd"]
    r = Replicas(eps, probe_every_s=0.01, clock=clock)  # type: ignore[arg-type]

    async def go() -> None:
        for _ in range(OUTLIER_FAILS):
            r._blame(0)
            r._blame(1)
        assert r.healthy == [False, False, True, True]
        clock.t += 10 * OUTLIER_COOLDOWN_S
        await asyncio.sleep(0.05)  # their probes ask /health: down, so they stay out
        assert r.healthy == [False, False, True, True]
        for _ in range(OUTLIER_FAILS):
            r._blame(2)
        assert r.healthy == [False, False, True, True]

    asyncio.run(go())


def test_two_broken_replicas_of_three_are_blamed_and_every_answer_is_whole():
    """Two replicas broken behind a /health that says 200, one good: a request fails at the
    first, then the second (each with its /health up), and goes on at the third, which blames
    both. One request at a time, every answer is whole; one of the two is out (at most half)."""
    clock = Clock()
    bad = [FakeEndpoint("http://a", broken_after=1), FakeEndpoint("http://b", broken_after=2)]
    good = FakeEndpoint("http://c")
    r = Replicas([*bad, good], probe_every_s=0.01, clock=clock)  # type: ignore[list-item]

    async def go() -> None:
        for _ in range(3 * OUTLIER_FAILS):
            items = await collect(r, 6)
            assert tokens(items) == unbroken(6)
        assert r.healthy == [False, True, True] and r.ejections == 1
        assert r._streak[1] >= OUTLIER_FAILS  # blamed each time, kept in by the cap

    asyncio.run(go())
    four = Replicas([FakeEndpoint("http://a", broken_after=1), FakeEndpoint("http://b", broken_after=0),  # type: ignore[list-item]
                     FakeEndpoint("http://c"), FakeEndpoint("http://d")], probe_every_s=0.01, clock=Clock())

    async def burst() -> list[list[object]]:
        async with httpx.AsyncClient() as client:
            async def one() -> list[object]:
                return [i async for i in four.stream(client, [1, 2, 3], SamplingParams(max_tokens=6), 6)]
            return list(await asyncio.gather(*[one() for _ in range(4 * OUTLIER_FAILS)]))

    assert all(tokens(items) == unbroken(6) for items in asyncio.run(burst()))
    assert four.healthy == [False, False, True, True]


def test_a_call_that_every_tried_replica_fails_blames_none_and_names_them():
    r = Replicas([FakeEndpoint(f"http://{c}", broken_after=1) for c in "abc"], probe_every_s=0.01,  # type: ignore[misc]
                 clock=Clock())
    with pytest.raises(RemoteStreamError) as err:
        asyncio.run(collect(r, 6))
    assert "as did http://a, http://b" in str(err.value) and r._streak == [0, 0, 0]
    assert [e.streams for e in r.endpoints] == [1, 1, 1]  # type: ignore[attr-defined]


def test_a_stream_closed_after_a_siblings_tokens_blames_the_replica_that_failed_it():
    """The caller read a token of the sibling's and closed the stream: the sibling answered,
    so the replica that failed the call first is blamed, and the sibling's own blame is cleared."""
    bad, good = FakeEndpoint("http://a", broken_after=2), FakeEndpoint("http://b")
    r = replicas(bad, good)
    r._streak[1] = 2

    async def go() -> list[int]:
        got: list[int] = []
        async with httpx.AsyncClient() as client:
            stream = r.stream(client, [1, 2, 3], SamplingParams(max_tokens=12), 12)
            async for item in stream:
                if isinstance(item, RemoteToken):
                    got.append(item.token_id)
                    if len(got) == 3:  # the sibling's first
                        break
            await stream.aclose()
        return got

    assert asyncio.run(go()) == unbroken(3)
    assert r._streak == [1, 0] and r.inflight == [0, 0]


def test_a_score_that_a_replica_fails_with_its_health_up_blames_it_when_a_sibling_answers():
    clock = Clock()
    bad, good = FakeEndpoint("http://a", broken_after=0), FakeEndpoint("http://b")
    r = Replicas([bad, good], probe_every_s=0.01, clock=clock)  # type: ignore[list-item]

    async def go() -> None:
        async with httpx.AsyncClient() as client:
            for i in range(OUTLIER_FAILS):
                assert [s.rank for s in await r.score(client, [1], [4, 5])] == [1, 1]
                assert r._streak[0] == (i + 1) % OUTLIER_FAILS
        assert r.healthy == [False, True] and (bad.calls, good.calls) == (OUTLIER_FAILS, OUTLIER_FAILS)

    asyncio.run(go())


def test_a_replica_the_audit_condemns_gets_no_stream_whatever_its_health_says_until_absolved():
    """condemn: out at once with no cap (its /health answers: no probe brings it back); every
    replica condemned: the rung is down (EndpointsDownError: the pool's requests go to the
    standby) and `alive` says so; absolve: its /health probe brings it back."""
    a, b = FakeEndpoint("http://a"), FakeEndpoint("http://b")
    r = replicas(a, b)

    async def run() -> None:
        r.condemn("http://a")
        assert r.healthy == [False, True] and r.condemned == 1
        for _ in range(3):
            assert tokens(await collect(r, 4)) == unbroken(4)
        await asyncio.sleep(0.1)  # ten probe periods: nothing rejoins a condemned replica
        assert (a.streams, b.streams, r.healthy) == (0, 3, [False, True])
        r.condemn("http://b")  # both: the rung is down, whatever their /health says
        with pytest.raises(EndpointsDownError):
            await collect(r, 4)
        async with httpx.AsyncClient() as client:
            assert not await r.alive(client)
        r.absolve("http://a")
        for _ in range(200):
            await asyncio.sleep(0.01)
            if r.healthy[0]:
                break
        assert r.healthy == [True, False] and r.endpoint_stats()[1]["condemned"]
        assert tokens(await collect(r, 4)) == unbroken(4) and a.streams == 1

    asyncio.run(run())


def test_each_attempt_of_a_stream_says_which_replica_writes_it():
    """RemoteAt before each endpoint's tokens (the audit's endpoint): one for an unbroken stream,
    a second after a migration."""
    r = replicas(FakeEndpoint("http://a", fail_after=3, up=False), FakeEndpoint("http://b"))
    items = asyncio.run(collect(r, 8))
    assert [i.endpoint for i in items if isinstance(i, RemoteAt)] == ["http://a", "http://b"]
    assert tokens(items) == unbroken(8)
