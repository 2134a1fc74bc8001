"""The remote pool's inter-token deadline, relative to the server's own prefills (serving/prefills.py),
on a real one-thread llama-server: a long prompt that joins the server's batch silences the
answer already streaming there for its whole prefill (seconds), far past a 0.6 s step deadline.
With the allowance (the default) that silence is owed to the prefill: no hazard, no handoff.
Without it (`prefill_allowance = False`, the fixed gap) the same silence is a deadline hazard:
the test can fail. An injected stall with no prefill beside it is still caught. (One server, one
engine: the suite's wall time.)"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from qladder.health.guard import GUARD_PRESETS
from qladder.model import user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.serving.remote import RemoteConfig
from qladder.testing.faults import parse_fault

from .conftest import get_engine

pytestmark = pytest.mark.slow
DEADLINE_S = 0.6


def _long(k: int) -> str:
    """A long prompt (~640 tokens: seconds of prefill on one thread), a different one per k (the
    server's prompt cache knows none)."""
    return " ".join(f"Line {i}: the {('red', 'blue', 'green', 'amber')[(i + k) % 4]} box holds {(i * 7 + k) % 13} "
                    "stones." for i in range(45))


def _engine(url: str, allowance: bool) -> ServingEngine:
    guard = dataclasses.replace(GUARD_PRESETS["default"], step_deadline_s=DEADLINE_S)
    return ServingEngine(ServingConfig(remote_url=url, allow_faults=True, ladder=LadderConfig(guard=guard),
                                       remote=RemoteConfig(prefill_allowance=allowance)),
                         standby_engines=[get_engine("fp32")])



def _beside_a_prefill(se: ServingEngine, k: int) -> tuple[object, float]:
    """An answer streaming while a long prompt joins the server: the answer's result, and the
    long prompt's time to its first token alone (the prefill the answer waited through)."""
    rung = se.int4
    short = user_prompt_ids(se.info.chat_template, "Count from one to one hundred in words.", rung.tokenize)
    first, long = (user_prompt_ids(se.info.chat_template, _long(k + i), rung.tokenize) for i in (0, 1))
    assert 500 < len(long) < 2000
    t0 = time.perf_counter()
    se.generate_sync(se.request(first, SamplingParams(max_tokens=1)))  # alone: measures the server's rate
    alone = time.perf_counter() - t0
    got: list = [None]

    def stream() -> None:
        got[0] = se.generate_sync(se.request(short, SamplingParams(max_tokens=160, ignore_eos=True)))

    t = threading.Thread(target=stream)
    t.start()
    steps = se.scheduler.steps
    deadline = time.monotonic() + 60
    while se.scheduler.steps < steps + 8:  # the answer is streaming
        assert time.monotonic() < deadline
        time.sleep(0.01)
    beside = se.generate_sync(se.request(long, SamplingParams(max_tokens=1)))
    t.join(180)
    assert beside.hazards == []
    return got[0], alone


def test_an_answer_beside_a_long_prefill_is_not_a_stall_with_the_allowance_and_is_without(model_info):
    with LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=4096) as server:
        se = _engine(server.base_url, allowance=True)
        try:
            r, alone = _beside_a_prefill(se, 0)
            print(f"the long prompt's prefill alone: {alone:.2f} s; rate {se.remote.prefills[0].rate:.0f} tok/s")
            assert alone > 2 * DEADLINE_S  # the silence it causes is well past the step deadline
            assert r.hazards == [] and r.handoffs == [] and set(r.token_rungs) == {"llama-server"}, r.hazards
            # an injected stall with no prefill beside it is still caught, the rate measured
            ids = user_prompt_ids(se.info.chat_template, "Name three colors.", se.int4.tokenize)
            r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=16), faults=[parse_fault("stall@step=5")]))
            assert r.hazards and r.hazards[0].check == "deadline" and r.hazards[0].step == 5, r.hazards
            # the fixed gap (the pool reads its config at every gap): the same silence is a stall
            se.remote.config = dataclasses.replace(se.remote.config, prefill_allowance=False)
            r, _ = _beside_a_prefill(se, 2)
            assert r.hazards and r.hazards[0].check == "deadline" and r.handoffs, r.hazards
        finally:
            se.close()
