"""One EngineClient contract, run on every implementation a front end may hold: the fake the HTTP
tests use (tests/fakes.py) and the real ServingEngine (INT4 batched + the fp32 standby)."""

from __future__ import annotations

import asyncio

import pytest

from qladder.client import EngineClient
from qladder.errors import InputError
from qladder.sampling import SamplingParams
from qladder.testing.faults import parse_fault
from qladder.types import Event, FinalEvent, FinishReason, HandoffEvent, HazardEvent, TokenEvent

from .conftest import get_engine
from .fakes import FakeClient


@pytest.fixture(scope="module", params=["fake", pytest.param("serving", marks=pytest.mark.slow)])
def client(request):
    if request.param == "fake":
        yield FakeClient()
        return
    import dataclasses

    from qladder.health.guard import GUARD_PRESETS
    from qladder.policy import LadderConfig
    from qladder.serving import ServingConfig, ServingEngine

    # not about deadlines: on a busy test machine (two workers, servers of other tests) a prefill
    # once took longer than the default step deadline, and its hazard replaced the one under test
    guard = dataclasses.replace(GUARD_PRESETS["default"], step_deadline_s=60.0)
    se = ServingEngine(ServingConfig(slots=2, allow_faults=True, ladder=LadderConfig(guard=guard)),
                       standby_engines=[get_engine("fp32")])
    yield se
    se.close()


def _prompt(client) -> list[int]:
    if isinstance(client, FakeClient):
        return [11, 12, 13, 14, 15, 16, 17, 18]
    from qladder.model import user_prompt_ids

    return user_prompt_ids(client.info.chat_template, "Name three colors.", client.int4.tokenize)


def _events(client, req) -> list[Event]:
    async def collect() -> list[Event]:
        return [ev async for ev in client.generate(req)]

    return asyncio.run(collect())


def _final(events: list[Event]) -> FinalEvent:
    finals = [e for e in events if isinstance(e, FinalEvent)]
    assert len(finals) == 1 and events[-1] is finals[0]  # one final event, and it is the last
    return finals[0]


class TestEngineClientContract:
    def test_protocol(self, client):
        assert isinstance(client, EngineClient) and client.ready
        assert len(client.rungs) == len(client.n_ctx) >= 2 and client.rungs[0] == "int4"
        assert {"slots", "slots_in_use", "queue_depth", "live"} <= set(client.stats())

    def test_events_add_up_to_the_final_result(self, client):
        req = client.request(_prompt(client), SamplingParams(max_tokens=6))
        events = _events(client, req)
        final = _final(events)
        assert all(e.request_id == req.request_id for e in events)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        r = final.result
        assert [t for e in tokens for t in e.token_ids] == r.token_ids and 0 < len(r.token_ids) <= 6
        assert [x for e in tokens for x in e.rungs] == r.token_rungs == ["int4"] * len(r.token_ids)
        assert "".join(e.text for e in tokens) == r.text
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and not r.hazards and not r.handoffs
        assert r.prompt_tokens == len(req.prompt_ids)

    def test_a_fault_shows_as_its_hazard_then_its_handoff(self, client):
        req = client.request(_prompt(client), SamplingParams(max_tokens=6, ignore_eos=True),
                             faults=[parse_fault("nan@step=1")])
        events = _events(client, req)
        r = _final(events).result
        kinds = [type(e) for e in events if isinstance(e, HazardEvent | HandoffEvent)]
        assert kinds == [HazardEvent, HandoffEvent]
        assert [e.hazard for e in events if isinstance(e, HazardEvent)] == r.hazards
        assert [e.handoff for e in events if isinstance(e, HandoffEvent)] == r.handoffs
        assert [(h.check, h.rung, h.step) for h in r.hazards] == [("nonfinite", "int4", 1)]
        assert r.token_rungs == ["int4"] + [client.rungs[1]] * (len(r.token_ids) - 1) and len(r.token_ids) > 1

    def test_a_prompt_no_rung_can_take_is_refused_at_submit(self, client):
        async def submit(ids: list[int]) -> None:  # generate() submits on the caller's running loop
            client.generate(client.request(ids, SamplingParams(max_tokens=4)))

        for ids in ([], [11] * max(client.n_ctx)):
            with pytest.raises(InputError):
                asyncio.run(submit(ids))
        assert client.stats()["live"] == 0

    def test_abort_of_a_request_not_in_flight_is_false(self, client):
        assert client.abort("no-such-request") is False
