"""The fleet benchmark's figures (validate/fleet_figures.py) on outcomes written here, one way to
fail each kill verdict: they are computed from each answer's own record, and an answer in flight
at the kill that never migrated cannot make the identity verdict pass."""

from __future__ import annotations

from typing import Any

from qladder.validate.fleet_figures import fleet_figures
from qladder.validate.outcome import Outcome

REF = [5, 6, 7, 8]


def _o(config: str, phase: str, start: float, end: float, ids: list[int], rnd: int = 0, **kw: Any) -> Outcome:
    return Outcome("t", config, kw.pop("pid", "p0"), "normal", "normal", phase=phase, round=rnd, start_s=start,
                   end_s=end, token_ids=ids, latency_ms=(end - start) * 1e3, verdict={"garbage": False}, **kw)


def _run(kill: list[Outcome]) -> dict[str, Any]:
    compare = [_o("fleet", "compare", r * 10, r * 10 + 1, REF, r) for r in range(3)]
    compare += [_o("llama_server_direct", "compare", r * 10 + 2, r * 10 + 3, REF, r) for r in range(3)]
    obs = {"kill": {"kill_clock_s": 100.0, "migrations": 1, "time_to_eject_s": 0.1, "time_to_rejoin_s": 1.0}}
    return fleet_figures(compare + kill, obs)


def _status(f: dict[str, Any], starts: str) -> str:
    return next(v["status"] for v in f["verdicts"] if v["name"].startswith(starts))


def test_a_migrated_answer_equal_to_the_unbroken_one_passes():
    f = _run([_o("fleet-a", "kill", 99, 101, REF, migrations=1), _o("fleet-b", "kill", 99, 101, REF, migrations=0)])
    assert f["kill"]["migrated_answers"] == 1 and f["kill"]["identical_share"] == 1.0
    assert _status(f, "kill: migrated answers identical") == "pass"
    assert _status(f, "kill: answers in flight that went on") == "pass"
    assert _status(f, "kill: hazards and handoffs") == "pass"


def test_a_migrated_answer_that_differs_fails_even_when_the_others_are_equal():
    f = _run([_o("fleet-a", "kill", 99, 101, [5, 6, 9, 9], migrations=1)]
             + [_o("fleet-b", "kill", 99, 101, REF, migrations=0) for _ in range(5)])  # unmigrated, equal: not counted
    assert f["kill"]["identical_share"] == 0.0
    assert _status(f, "kill: migrated answers identical") == "fail"


def test_no_answer_migrated_proves_nothing_and_fails():
    f = _run([_o("fleet-b", "kill", 99, 101, REF, migrations=0) for _ in range(4)])
    assert f["kill"]["in_flight_at_kill"] == 4 and f["kill"]["migrated_answers"] == 0
    assert _status(f, "kill: answers in flight that went on") == "fail"
    assert _status(f, "kill: migrated answers identical") != "pass"


def test_a_hazard_or_a_handoff_in_the_kill_phase_fails():
    f = _run([_o("fleet-a", "kill", 99, 101, REF, migrations=1, hazards=["deadline"], handoff_ms=[3.0])])
    assert _status(f, "kill: hazards and handoffs") == "fail"


def test_every_answer_is_judged_and_llama_servers_text_is_retokenized(model_info):
    """benchmarks.common.judge_answers (bench serve and the fleet bench): llama-server's chat stream
    gives no ids, so its answer is re-tokenized from its text and flagged; a gateway's keeps its
    own ids; each is judged (a flood of dots is garbage whichever way its ids came)."""
    from qladder.benchmarks.common import judge_answers

    direct = Outcome("t", "llama_server_direct", "p0", "normal", "normal", text="The sky is blue.")
    flood = Outcome("t", "llama_server_direct", "p1", "normal", "normal", text="." * 64)
    gateway = Outcome("t", "fleet", "p0", "normal", "normal", text="The sky is blue.", token_ids=[1, 2, 3])
    failed = Outcome("t", "llama_server_direct", "p2", "normal", "normal", status=500, error="boom")
    judge_answers([direct, flood, gateway, failed], model_info)
    assert direct.token_ids_source == "retokenized" and len(direct.token_ids) >= 4
    assert direct.rungs == ["llama-server"] * len(direct.token_ids)
    assert direct.verdict["garbage"] is False and flood.verdict["garbage"] is True
    assert gateway.token_ids == [1, 2, 3] and gateway.token_ids_source != "retokenized" and gateway.verdict
    assert failed.verdict == {} and failed.token_ids == []
