"""Elastic cores (serving/cores.py): the INT4 pool decodes on every core the standby is not using."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from qladder.config import Settings
from qladder.errors import ConfigError
from qladder.health.guard import GUARD_PRESETS
from qladder.model import user_prompt_ids
from qladder.policy import LadderConfig
from qladder.sampling import SamplingParams
from qladder.server.serve import serving_config
from qladder.server.topology import Topology, parse_topology
from qladder.serving import ServingConfig, ServingEngine
from qladder.serving.cores import Cores, int4_threads
from qladder.testing.faults import parse_fault
from qladder.validate.replay import greedy

from .conftest import get_engine


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_int4_takes_every_core_only_while_the_standby_has_been_idle_for_the_linger():
    assert int4_threads(2, 2, 1, standby_busy=False, idle_for_s=10.0, linger_s=0.25) == 2
    assert int4_threads(2, 2, 1, standby_busy=True, idle_for_s=10.0, linger_s=0.25) == 1
    assert int4_threads(2, 2, 1, standby_busy=False, idle_for_s=0.1, linger_s=0.25) == 1
    assert int4_threads(16, 16, 4, standby_busy=True, idle_for_s=0.0, linger_s=0.25) == 12
    assert int4_threads(16, 8, 4, standby_busy=False, idle_for_s=1.0, linger_s=0.25) == 8  # its cap
    assert int4_threads(1, 1, 1, standby_busy=True, idle_for_s=0.0, linger_s=0.25) == 1  # never 0


def test_cores_follow_the_standbys_reports_on_an_injected_clock():
    clock = FakeClock()
    cores = Cores(2, linger_s=0.25)
    assert cores.int4_want(2, 1, clock()) == 2  # a standby that never worked
    cores.standby_turn(True, clock())  # a handoff arrives
    assert cores.int4_want(2, 1, clock()) == 1  # the very next decode leaves it its core
    clock.t += 5.0
    assert cores.int4_want(2, 1, clock()) == 1  # still working (no report of idleness yet)
    cores.standby_turn(False, clock())  # drained
    clock.t += 0.1
    assert cores.int4_want(2, 1, clock()) == 1  # within the linger
    clock.t += 0.2
    assert cores.int4_want(2, 1, clock()) == 2  # back to every core
    assert cores.int4_by_threads == {2: 2, 1: 3}


def test_an_audit_holds_its_core_while_it_runs_and_leaves_no_linger():
    """The linger follows requests' work (the next handoff token comes at once); an audit chunk
    that ends gives INT4 every core back at its next decode."""
    clock = FakeClock()
    cores = Cores(2, linger_s=0.25)
    cores.standby_turn(True, clock(), requests=False)  # an audit chunk runs
    assert cores.int4_want(2, 1, clock()) == 1
    cores.standby_turn(False, clock(), requests=False)  # it ended
    assert cores.int4_want(2, 1, clock()) == 2  # no linger
    cores.standby_turn(True, clock(), requests=True)  # a handoff, then an audit after it
    cores.standby_turn(True, clock(), requests=False)
    cores.standby_turn(False, clock(), requests=False)
    clock.t += 0.1
    assert cores.int4_want(2, 1, clock()) == 1  # within the handoff's linger
    clock.t += 0.2
    assert cores.int4_want(2, 1, clock()) == 2


def test_a_waiting_standby_is_served_before_int4_leases_again_and_leases_never_oversubscribe():
    """INT4 holds both cores; the standby queues for one; INT4's decode ends and it leases again at
    once: the standby, first in line, gets its core, INT4 the one left (a lease that ignored the
    queue would give INT4 both again and leave the standby waiting)."""
    cores = Cores(2)
    first = cores.lease(2)  # INT4 decodes on both cores
    assert first == 2 and cores.free == 0
    got: list[int] = []

    def standby() -> None:
        got.append(cores.lease(1))

    t = threading.Thread(target=standby, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not cores._queue:  # the standby is in the lease queue
        assert time.monotonic() < deadline, "the standby's lease did not queue within 10 s"
        time.sleep(0.001)
    cores.release(first)  # INT4's decode ends...
    again = cores.lease(2)  # ...and it asks again at once
    t.join(10)
    try:
        assert got == [1] and again == 1
        assert cores.max_in_use <= 2
    finally:
        cores.release(again)
        if got:
            cores.release(got[0])


def test_the_server_default_is_elastic_int4_on_every_cpu_and_threads_on_a_pool_fix_it():
    s = Settings.from_env()
    default = serving_config(Topology(), s)
    cpus = Topology().cores.cpus
    assert (default.cores, default.int4_threads, default.standby_threads) == (cpus, cpus, 1)
    fixed = parse_topology({"cores": {"int4": 1}})
    c = serving_config(fixed, s)
    assert (c.cores, c.int4_threads) == (None, 1)
    def pools(threads: int) -> list[dict[str, object]]:
        return [{"name": "int4", "rungs": ["int4"], "threads": threads, "weight": 1.0, "handoff_to": "standby"},
                {"name": "standby", "rungs": ["fp32"]}]

    old = parse_topology({"pools": pools(2)})
    assert old.cores.int4 == 2 and serving_config(old, s).cores is None
    with pytest.raises(ConfigError, match="disagree"):
        parse_topology({"cores": {"int4": "elastic"}, "pools": pools(1)})
    with pytest.raises(ConfigError) as e:
        parse_topology({"cores": {"int4": "all", "total": -1, "linger_s": -1.0}})
    msg = str(e.value)
    assert "cores.int4" in msg and "cores.total" in msg and "cores.linger_s" in msg
    with pytest.raises(ConfigError, match="unknown key 'x'"):
        parse_topology({"cores": {"x": 1}})


@pytest.mark.slow
def test_a_handoff_under_elastic_cores_continues_as_fp32_and_int4s_answers_do_not_depend_on_its_threads():
    """Two cores, INT4 elastic, the default (fast) mode: a clean answer alone runs on 2 threads;
    beside a faulted one its decodes drop to 1 thread while the standby continues the faulted
    answer, and its tokens are the same. The faulted answer's continuation is fp32's greedy one."""
    guard = GUARD_PRESETS["default"]
    # A step deadline far past any decode: two OpenMP threads on a box whose other test worker
    # takes its cores can stall at llama.cpp's barriers for seconds, and this test is not about that.
    guard = dataclasses.replace(guard, step_deadline_s=60.0)
    cfg = ServingConfig(slots=4, int4_threads=2, standby_threads=1, cores=2, allow_faults=True,
                        ladder=LadderConfig(guard=guard))
    se = ServingEngine(cfg, standby_engines=[get_engine("fp32")])
    try:
        assert se.cores is not None
        ids = [user_prompt_ids(se.info.chat_template, p, se.int4.tokenize)
               for p in ("Explain gravity in one sentence.", "Write a haiku about rain.")]
        long_params, short = SamplingParams(max_tokens=48, ignore_eos=True), SamplingParams(max_tokens=24)
        alone = se.generate_sync(se.request(ids[0], long_params))
        assert se.cores.int4_by_threads.get(2, 0) > 0 and set(alone.token_rungs) == {"int4"}, alone.hazards
        before = dict(se.cores.int4_by_threads)
        out: dict[str, Any] = {}
        a = threading.Thread(target=lambda: out.__setitem__("a", se.generate_sync(se.request(ids[0], long_params))))
        a.start()
        b = se.generate_sync(se.request(ids[1], short, faults=[parse_fault("nan@step=4")]))
        a.join(120)
        assert not a.is_alive(), "the clean answer did not end within 120 s"
        assert [h.to_rung for h in b.handoffs] == ["fp32"]
        assert b.token_ids[4:] == greedy(get_engine("fp32"), ids[1] + b.token_ids[:4], len(b.token_ids) - 4)
        assert out["a"].token_ids == alone.token_ids
        assert se.cores.int4_by_threads.get(1, 0) > before.get(1, 0)  # INT4 gave the standby its core
        assert se.cores.max_in_use <= 2
    finally:
        se.close()
