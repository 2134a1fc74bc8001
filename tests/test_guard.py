"""Health checks and the pure policy: exact verdicts on constructed rows and histories."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qladder.health import GUARD_PRESETS, GuardConfig, StepGuard, find_repetition
from qladder.health.guard import RemoteChecks
from qladder.policy import Continue, Handoff, LadderPolicy, Stop
from qladder.testing.faults import parse_fault
from qladder.types import FinishReason, Hazard

V = 49152


def _normal_row(seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(V, generator=g) * 2.0  # (V,)
    row[123] = 25.0  # a confident next token, as a language model has
    return row


def test_healthy_row_passes():
    assert StepGuard().check(_normal_row(), [], "int4") is None


@pytest.mark.parametrize("value,check", [(math.nan, "nonfinite"), (math.inf, "nonfinite"),
                                         (-math.inf, "nonfinite"), (1e6, "magnitude")])
def test_single_bad_entry_is_caught(value, check):
    row = _normal_row()
    row[7] = value
    h = StepGuard().check(row, [1, 2, 3], "int4")
    assert h is not None and h.check == check and h.step == 3 and h.rung == "int4"


def test_all_nan_row_is_caught_and_never_healed():
    row = torch.full((V,), math.nan)
    h = StepGuard().check(row, [], "int4")
    assert h is not None and h.check == "nonfinite"
    # nan_to_num would have made it uniform: the guard also rejects that "healed" row.
    healed = torch.nan_to_num(row)
    h2 = StepGuard().check(healed, [], "int4")
    assert h2 is not None and h2.check == "flat"


@pytest.mark.parametrize("row", [torch.zeros(V), torch.full((V,), 3.5), torch.randn(V) * 0.1])
def test_flat_rows_are_caught(row):
    h = StepGuard().check(row, [], "int4")
    assert h is not None and h.check == "flat" and h.value is not None and h.value < h.threshold


@pytest.mark.parametrize("n", [1_000, V])
def test_flat_threshold_is_relative_to_the_vocabulary(n):
    """The bound is on the top probability against uniform (64 / V), not an absolute probability
    (the write-up's `max_prob < 1e-7` can never fire at V = 49,152, where uniform is 2e-5): one
    token a little under ln(64) above the rest is flat at any V, a little over is not."""
    row = torch.zeros(n)
    row[0] = math.log(64.0) * 0.99
    assert torch.softmax(row, -1).max() < 64.0 / n
    h = StepGuard().check(row, [], "int4")
    assert h is not None and h.check == "flat"
    row[0] = math.log(64.0) * 1.01
    assert StepGuard().check(row, [], "int4") is None


def test_activation_headroom_fires_on_the_first_layer_over_the_limit():
    peaks = torch.tensor([100.0] * 11 + [50_000.0, math.inf, math.nan] + [10.0] * 16)
    h = StepGuard().check(_normal_row(), [], "w4a16", peaks, 65504.0)
    assert h is not None and (h.check, h.layer, h.value) == ("activation", 11, 50_000.0)
    assert h.threshold == pytest.approx(0.6 * 65504.0)
    ok = torch.tensor([30_736.0] + [1000.0] * 29)  # SmolLM2's natural fp16 peak: 47%
    assert StepGuard().check(_normal_row(), [], "w4a16", ok, 65504.0) is None


def test_activation_nan_counts_as_over():
    peaks = torch.tensor([1.0, math.nan, 1.0])
    h = StepGuard().check(_normal_row(), [], "w4a16", peaks, 65504.0)
    assert h is not None and h.layer == 1 and math.isnan(h.value)


def test_off_preset_checks_nothing():
    row = torch.full((V,), math.nan)
    assert StepGuard(GUARD_PRESETS["off"]).check(row, [5] * 100, "int4", torch.tensor([math.inf]), 1.0) is None


def test_repetition_loop_is_caught():
    cfg = GuardConfig()
    loop = [1, 2, 3] + [7, 8, 9, 10] * 10
    h = StepGuard(cfg).check(_normal_row(), loop, "int4")
    assert h is not None and h.check == "repetition" and h.value == 4.0
    assert StepGuard(cfg).check(_normal_row(), list(range(100)), "int4") is None


def test_short_loops_are_caught_sooner_than_long_ones():
    g = StepGuard(GuardConfig())
    assert g.check(_normal_row(), [1, 2] + [40] * 12, "int4").value == 1.0  # 12 tokens of '('
    assert g.check(_normal_row(), [1, 2] + [40] * 11, "int4") is None
    assert g.check(_normal_row(), [1, 2] + [5, 6] * 6, "int4").value == 2.0
    long = list(range(20)) * 3  # period 20: the long rule (8 repeats) decides
    assert g.check(_normal_row(), long, "int4") is None
    assert g.check(_normal_row(), list(range(20)) * 8, "int4").value == 20.0


def test_loop_start_exact():
    from qladder.health.repetition import loop_start

    assert loop_start([1, 2, 3, 9, 9, 9, 9], 1) == 3
    assert loop_start([1, 5, 6, 5, 6, 5, 6], 2) == 1
    assert loop_start([5, 6, 5, 6], 2) == 0
    assert loop_start([1, 2, 3], 1) == 2 and loop_start([4], 1) == 0


def test_find_repetition_exact():
    assert find_repetition([5] * 40, 1, 8, 8, 32) == 1
    assert find_repetition([5] * 31, 1, 8, 8, 32) is None  # span too short
    assert find_repetition([1, 2] * 16, 1, 8, 8, 32) == 2
    assert find_repetition([1, 2] * 16 + [3], 1, 8, 8, 32) is None
    assert find_repetition([], 1, 8, 2) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=200), st.integers(1, 6), st.integers(2, 5))
def test_find_repetition_agrees_with_brute_force(ids, max_p, reps):
    got = find_repetition(ids, 1, max_p, reps)
    expected = None
    for p in range(1, max_p + 1):
        span = p * reps
        if span <= len(ids) and p < len(ids) and all(ids[-span + i] == ids[-span + i + p] for i in range(span - p)):
            expected = p
            break
    assert got == expected


# -- policy --------------------------------------------------------------------------------------

def _h(check="nonfinite"):
    return Hazard(check, "int4", 3)


def test_policy_climbs_then_falls_back():
    p = LadderPolicy()
    assert p.on_hazard(_h(), 0, 2, 0) == Handoff(1)
    assert p.on_hazard(_h(), 1, 2, 1) == Stop(FinishReason.DEGRADED, fallback=True)
    assert p.on_hazard(_h(), 0, 1, 0) == Stop(FinishReason.DEGRADED, fallback=True)


def test_policy_model_loop_stops_without_climbing():
    p = LadderPolicy()
    assert p.on_hazard(_h("repetition"), 0, 2, 0, reproduced=True) == Stop(FinishReason.REPETITION, False)
    assert p.on_hazard(_h("repetition"), 0, 2, 0, reproduced=False) == Handoff(1)
    assert p.on_hazard(_h("repetition"), 1, 2, 1) == Stop(FinishReason.REPETITION, False)


def test_policy_return_after_k_and_bound():
    p = LadderPolicy(return_after=3, max_handoffs=4)
    assert p.on_token(1, 2, 1) == Continue()
    assert p.on_token(1, 3, 1) == Handoff(0)
    assert p.on_token(0, 99, 1) == Continue()
    assert p.on_token(1, 3, 4) == Continue()
    assert p.on_hazard(_h(), 0, 2, 4) == Stop(FinishReason.DEGRADED, fallback=True)
    assert LadderPolicy().on_token(1, 1000, 1) == Continue()


# -- fault specs ------------------------------------------------------------------------------------

def test_parse_faults():
    f = parse_fault("gain@layer=11,channel=507,x=2.5")
    assert (f.kind, f.layer, f.channel, f.x) == ("gain", 11, 507, 2.5)
    assert str(f) == "gain@layer=11,channel=507,x=2.5"
    assert parse_fault("nan@step=4").step == 4
    assert parse_fault("stall@step=1,s=0.5").stall_s == 0.5


@pytest.mark.parametrize("spec", ["nan@step=-1", "gain@layer=1", "nan@stp=1", "nan@step", "x@step=1",
                                  "gain@layer=a,x=2"])
def test_bad_fault_specs_are_config_errors(spec):
    from qladder.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_fault(spec)


def test_outlier_away_from_the_first_position_is_caught_with_headroom_left():
    ceiling_only = GuardConfig(outlier_layer_limits=None)
    peaks = torch.tensor([25_000.0] * 30)  # the first position's massive activation: normal
    rest = torch.tensor([900.0] * 12 + [12_000.0] + [900.0] * 17)
    h = StepGuard(ceiling_only).check(_normal_row(), [], "int4", peaks, 65504.0, rest)
    assert h is not None and (h.check, h.layer, h.value) == ("outlier", 12, 12_000.0)
    assert h.threshold == GuardConfig().outlier_limit
    calm = torch.tensor([1_500.0] * 30)
    assert StepGuard(ceiling_only).check(_normal_row(), [], "int4", peaks, 65504.0, calm) is None
    # The headroom check comes first; without an outlier bound the rest is not checked.
    off = GuardConfig(outlier_limit=None, outlier_layer_limits=None)
    assert StepGuard(off).check(_normal_row(), [], "int4", peaks, 65504.0, rest) is None


def test_per_layer_outlier_bounds_catch_a_quiet_layer_under_the_ceiling():
    limits = (100.0, 400.0, 3000.0, 300.0)  # the third is capped by the 2,000 ceiling
    cfg = GuardConfig(outlier_limit=2000.0, outlier_layer_limits=limits, outlier_layer_limits_model=None)
    peaks = torch.tensor([25_000.0] * 4)
    # 600 in layer 3 is far under the ceiling, but twice what that layer carries on clean traffic.
    h = StepGuard(cfg).check(_normal_row(), [], "int4", peaks, 65504.0, torch.tensor([50.0, 300.0, 1500.0, 600.0]))
    assert h is not None and (h.check, h.layer, h.value, h.threshold) == ("outlier", 3, 600.0, 300.0)
    h = StepGuard(cfg).check(_normal_row(), [], "int4", peaks, 65504.0, torch.tensor([50.0, 300.0, 2500.0, 60.0]))
    assert h is not None and (h.layer, h.threshold) == (2, 2000.0)
    assert StepGuard(cfg).check(_normal_row(), [], "int4", peaks, 65504.0,
                                torch.tensor([90.0, 390.0, 1900.0, 290.0])) is None
    # Limits calibrated for another depth are not applied: the ceiling alone decides.
    six = torch.tensor([600.0] * 6)
    assert StepGuard(cfg).check(_normal_row(), [], "int4", torch.tensor([25_000.0] * 6), 65504.0, six) is None
    assert StepGuard(cfg).outlier_bounds(6) == [2000.0] * 6


@pytest.mark.parametrize("values,limit", [
    ([1.0, 5.0, 3.0], 4.0), ([1.0, 2.0, 3.0], 4.0), ([1.0, float("nan"), 9.0], 4.0),
    ([50.0, 300.0, 600.0], [100.0, 400.0, 300.0]), ([50.0, 300.0, 200.0], [100.0, 400.0, 300.0])])
def test_host_and_tensor_first_over_agree(values, limit):
    """CPU peaks are compared in Python, device peaks with tensor ops: the same verdict."""
    from qladder.health.guard import _first_over, _first_over_host

    t_limit = torch.tensor(limit) if isinstance(limit, list) else limit
    dev = [float(v) for v in torch.stack(_first_over(torch.tensor(values), t_limit)).tolist()]
    host = _first_over_host(values, limit)
    assert dev[0] == host[0]
    if host[0]:
        assert dev[1:] == pytest.approx(host[1:], nan_ok=True)


def test_calibrated_bounds_are_keyed_by_the_model_not_its_depth(caplog, model_info):
    """SmolLM2's per-layer bounds apply to SmolLM2 (and patched copies of it), not to another
    30-layer model, which gets the ceiling alone and a warning."""
    from qladder.health.guard import SMOLLM2_IDENTITY, SMOLLM2_OUTLIER_LIMITS

    assert model_info.identity == SMOLLM2_IDENTITY
    assert StepGuard(GuardConfig(), model_info.identity).outlier_bounds(30) == [
        min(v, 2000.0) for v in SMOLLM2_OUTLIER_LIMITS]
    with caplog.at_level("WARNING", logger="qladder.guard"):
        other = StepGuard(GuardConfig(), "Another 30-layer model|llama|L30|D576|V49152|ft3")
    assert other.outlier_bounds(30) == [2000.0] * 30
    assert "calibrated on" in caplog.text
    rest = torch.tensor([50.0] + [100.0] * 29)
    rest[10] = 900.0  # over layer 10's calibrated 410, under the ceiling
    peaks = torch.tensor([25_000.0] * 30)
    assert StepGuard(GuardConfig(), SMOLLM2_IDENTITY).check(_normal_row(), [], "int4", peaks, 65504.0, rest).layer == 10
    assert other.check(_normal_row(), [], "int4", peaks, 65504.0, rest) is None


# -- the remote guard: what a serving engine's stream says of each token ---------------------------------

def _remote(logprob, top=(), text=None, tid=7):
    from qladder.health.remote import RemoteToken

    return RemoteToken(tid, logprob, text, tuple(top))


def test_remote_guard_flags_null_nan_and_clamped_logprobs_and_flat_top_k():
    from qladder.health.remote import check_remote

    g = StepGuard(GUARD_PRESETS["default"])
    V = 49152
    assert check_remote(g, _remote(-0.1, [(7, -0.1), (9, -3.0)]), [], "llama-server", V, None) is None
    for bad in (None, float("nan"), float("-inf"), -9999.0):  # -9999.0: vLLM's stand-in for -inf
        h = check_remote(g, _remote(bad, [(7, -0.1)]), [], "llama-server", V, None)
        assert h is not None and h.check == "nonfinite"
    flat = -math.log(V) + 0.5  # under the in-process bound exp(flat_gap) / V
    assert check_remote(g, _remote(flat, [(7, flat)]), [], "vllm", V, None).check == "flat"


def test_remote_guard_checks_the_streamed_text_against_the_vocabulary():
    from qladder.health.remote import check_remote

    g = StepGuard(GUARD_PRESETS["default"])
    ok = check_remote(g, _remote(-0.2, text=b" the"), [], "llama-server", 100, b" the")
    dropped = check_remote(g, _remote(-0.2, text=b"\xf0\x9f\x91\xa8"), [], "llama-server", 100, b"\xa8")
    assert ok is None and dropped is not None and dropped.check == "mismatch"


def test_remote_guard_sees_a_diffused_distribution_only_where_a_higher_rung_can_take_over():
    from qladder.health.remote import check_remote

    g = StepGuard(GuardConfig(remote=RemoteChecks(diffuse_window=4, diffuse_logprob=-2.0)))
    sure, unsure = [-0.3] * 3, [-2.5] * 3
    assert check_remote(g, _remote(-0.4), [1, 2, 3], "llama-server", 49152, None, sure, can_climb=True) is None
    h = check_remote(g, _remote(-2.6), [1, 2, 3], "llama-server", 49152, None, unsure, can_climb=True)
    assert h is not None and h.check == "diffuse" and h.value < -2.0
    assert check_remote(g, _remote(-2.6), [1, 2, 3], "vllm", 49152, None, unsure, can_climb=False) is None
    # before the first full window, the prefix mean has its own (lower) bound: diffuse_first_logprob
    assert check_remote(g, _remote(-2.6), [1], "llama-server", 49152, None, [-2.0], can_climb=True) is None
    early = check_remote(g, _remote(-3.0), [1], "llama-server", 49152, None, [-2.5], can_climb=True)
    assert early is not None and early.check == "diffuse" and early.threshold == g.config.remote.diffuse_first_logprob


def _remote_machine(window: int = 8):
    from qladder.client import Request
    from qladder.machine import RequestMachine
    from qladder.policy import LadderConfig
    from qladder.serving.remote_visit import RemoteVisit

    cfg = LadderConfig(guard=GuardConfig(remote=RemoteChecks(diffuse_window=window, diffuse_logprob=-2.2)))
    m = RequestMachine(Request("r", (1, 2, 3)), ["llama-server", "vllm"], [512, 512], frozenset({0}),
                       lambda ids: b"".join(b"%d " % i for i in ids), cfg, StepGuard(cfg.guard), emit=lambda e: None)
    return RemoteVisit(m)


def _remote_token(t: int, lp: float | None):
    from qladder.health.remote import RemoteToken

    return RemoteToken(t, lp, None, ((t, lp),))


def test_an_answers_first_window_streams_sure_tokens_at_once_and_a_diffused_one_rolls_back_from_its_first_unsure():
    """Released on confidence within an answer's first window (8 tokens): a token at or over the
    diffuse bounds cannot take a window's (or a prefix's) mean under them, so sure tokens go out as
    they come; the unsure ones are held from the first, and a diffused prefix is rolled back there."""
    from qladder.actions import MoveTo

    visit = _remote_machine()
    m = visit.m
    assert m.stream.hold == 0 and visit.reach == 7
    released, h = [], None
    for t, lp in ((10, -0.1), (11, -0.2), (12, -0.1), (13, -0.3), (14, -6.0), (15, -6.0), (16, -6.0)):
        h = visit.judge(_remote_token(t, lp), 0.01, 49152, None)
        if h is not None:
            break
        m.accept_token(t)
        released.append(m.stream.released)
    assert released == [1, 2, 3, 4, 4, 4]  # each sure one out as it comes; 14 on, held
    assert h is not None and h.check == "diffuse" and h.step == 6  # the prefix averages -2.67 (under -2.5)
    assert isinstance(m.on_hazard(h, None), MoveTo)
    assert m.accepted == [10, 11, 12, 13] and m.context == [1, 2, 3, 10, 11, 12, 13]  # what was shown
    assert m.token_rungs == ["llama-server"] * 4


def test_past_the_first_window_a_remote_rung_holds_its_last_seven_again():
    """An unsure token is held with what follows it; past the answer's first window the last 7
    are held whatever they are (a confident flood stays unreleased until the repetition rule sees
    it), so the stream waits once for that lag to build up."""
    visit = _remote_machine()
    m = visit.m
    released = []
    for t, lp in enumerate((-0.1, -2.5, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1), start=10):
        assert visit.judge(_remote_token(t, lp), 0.01, 49152, None) is None
        m.accept_token(t)
        released.append(m.stream.released)
    assert released == [1] * 8 + [2, 3, 4]  # 11 held (unsure) with what follows; from the 9th, the last 7
    sure = _remote_machine()
    out = []
    for t in range(10, 21):
        assert sure.judge(_remote_token(t, -0.1), 0.01, 49152, None) is None
        sure.m.accept_token(t)
        out.append(sure.m.stream.released)
    assert out == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8]  # the first window out at once, then the lag builds up
    from qladder.client import Request
    from qladder.machine import RequestMachine
    from qladder.serving.remote_visit import RemoteVisit

    top = RemoteVisit(RequestMachine(Request("s", (1, 2, 3)), ["llama-server"], [512], frozenset({0}),
                                     lambda ids: b"", m.config, StepGuard(m.config.guard), emit=lambda e: None))
    assert top.reach == 0  # no rung above: nothing to roll back to, nothing held


def test_check_draft_refuses_the_first_token_the_standby_finds_far_less_likely():
    from qladder.health.remote import check_draft

    draft, own = [5, 6, 7, 8], [-0.1, -0.5, -0.2, -0.3]
    assert check_draft(draft, own, [-0.3, -2.0, -4.0, -1.0], "llama-server", "vllm", 8.0) is None  # differs, plausibly
    h = check_draft(draft, own, [-0.3, -12.0, -15.0, -1.0], "llama-server", "vllm", 8.0, start=3)
    assert h is not None and h.check == "verify" and h.step == 3 + 1 and h.value == -0.5 + 12.0
    # a rare token the rung itself drew as rare (sampling) is not refused: the gap is relative
    assert check_draft([9], [-9.0], [-11.0], "llama-server", "vllm", 8.0) is None
    assert check_draft([9], [-0.1], [float("nan")], "llama-server", "vllm", 8.0) is None  # the standby said nothing
    assert check_draft([9], [-0.1], [-9999.0], "llama-server", "vllm", 8.0) is not None  # vLLM's -inf clamp


def _draft_machine(max_tokens: int = 16):
    from qladder.client import Request
    from qladder.machine import RequestMachine
    from qladder.policy import LadderConfig
    from qladder.sampling import SamplingParams
    from qladder.serving.remote_visit import RemoteVisit

    events = []
    cfg = LadderConfig(guard=GuardConfig(remote=RemoteChecks(diffuse_window=4, diffuse_logprob=-2.0)))
    m = RequestMachine(Request("r", (1, 2, 3), SamplingParams(max_tokens=max_tokens)), ["llama-server", "vllm"],
                       [512, 512], frozenset({0}), lambda ids: b"".join(b"%d " % i for i in ids), cfg,
                       StepGuard(cfg.guard), emit=events.append)
    visit = RemoteVisit(m)
    visit.await_draft_check(5)
    return visit, events


def _feed(visit, tokens):
    from qladder.health.remote import RemoteToken

    action = None
    for t in tokens:
        assert visit.judge(RemoteToken(t, -0.1, None, ((t, -0.1),)), 0.01, 49152, None) is None
        action = visit.m.accept_token(t)
    return action


def test_a_draft_awaiting_the_standby_is_held_whole_and_a_refusal_keeps_the_tokens_before_it():
    from qladder.actions import MoveTo
    from qladder.types import Hazard, TokenEvent

    visit, events = _draft_machine()
    m = visit.m
    _feed(visit, [10, 11, 12, 13, 14])  # the pool checks the draft here, at 5 tokens
    assert m.unchecked and m.stream.released == 0 and not [e for e in events if isinstance(e, TokenEvent)]
    assert visit.drawn == [-0.1] * 5
    action = m.on_hazard(Hazard("verify", "llama-server", 2, 12.0, 8.0), None)
    assert isinstance(action, MoveTo) and action.rung == 1
    assert m.context == [1, 2, 3, 10, 11] and not m.unchecked  # the standby continues after the passed ones


def test_a_passed_draft_is_released_as_a_remote_rung_releases_and_an_early_end_waits_for_the_check():
    from qladder.actions import Confirm
    from qladder.types import FinishReason, TokenEvent

    visit, events = _draft_machine()
    m = visit.m
    _feed(visit, [10, 11, 12, 13, 14])
    visit.draft_checked()  # past the first window (4 tokens here): the last 3 held, as a remote rung holds them
    assert not m.unchecked and m.stream.hold == 3 and m.stream.released == 2
    assert [e.token_ids for e in events if isinstance(e, TokenEvent)] == [[10, 11]]

    short, _ = _draft_machine(max_tokens=3)
    action = _feed(short, [10, 11, 12])  # the length ends it inside the draft: the check comes first
    assert isinstance(action, Confirm) and action.reason is FinishReason.LENGTH and short.m.done is None
    eos = _feed(_draft_machine()[0], [10, 0])
    assert isinstance(eos, Confirm) and eos.reason is FinishReason.STOP
    short.draft_checked()
    assert short.m.finish(action.reason).token_ids == [10, 11, 12]


def test_row_faults_corrupt_from_their_step_on_and_stall_once():
    from qladder.engines.base import StepOutput
    from qladder.errors import EngineError
    from qladder.testing.faults import RowFaults, row_faults

    assert row_faults([parse_fault("gain@layer=11,channel=507,x=3")]) is None  # no step fault: nothing installed
    f = RowFaults([parse_fault("nan@step=2"), parse_fault("stall@step=1,s=0.5")])
    out = StepOutput(_normal_row(), (1.0, 2.0, 3.0))
    assert f.output(out, 1) is out  # before its step: the engine's own output, stats kept
    for k in (2, 3):
        hit = f.output(out, k)
        assert torch.isnan(hit.row).all() and hit.stats is None and not torch.isnan(out.row).any()
    assert (f.stall(0), f.stall(1), f.stall(1)) == (None, 0.5, None)  # a stall hangs its step once
    with pytest.raises(EngineError, match="injected kernel error at step 4"):
        RowFaults([parse_fault("error@step=4")]).output(out, 4)


def test_token_faults_hit_their_step_only():
    """A remote rung streams sampled tokens: a fault changes the token of its own step (the server
    has sampled on), never the ones after."""
    from qladder.errors import EngineError
    from qladder.health.remote import RemoteToken
    from qladder.testing.faults import TokenFaults, token_faults

    assert token_faults([]) is None
    tok = RemoteToken(7, -0.1, b"a", ((7, -0.1), (8, -2.0)))
    f = TokenFaults([parse_fault("nan@step=3"), parse_fault("zero@step=4"), parse_fault("stall@step=5,s=2")])
    assert f.token(tok, 0.01, 2, V) == (tok, 0.01) and f.token(tok, 0.01, 6, V) == (tok, 0.01)
    nan, took = f.token(tok, 0.01, 3, V)
    assert math.isnan(nan.logprob) and nan.token_id == 7 and took == 0.01
    flat, _ = f.token(tok, 0.01, 4, V)
    assert flat.logprob == pytest.approx(-math.log(V)) and flat.top == ()
    assert f.token(tok, 0.01, 5, V) == (tok, 2.0)
    with pytest.raises(EngineError):
        TokenFaults([parse_fault("error@step=1")]).token(tok, 0.01, 1, V)


def test_a_held_window_whose_release_completes_a_stop_string_ends_the_answer_there():
    from qladder.client import Request
    from qladder.machine import RequestMachine
    from qladder.policy import LadderConfig
    from qladder.sampling import SamplingParams
    from qladder.serving.remote_visit import RemoteVisit
    from qladder.types import FinishReason

    cfg = LadderConfig(guard=GuardConfig(remote=RemoteChecks(diffuse_window=4, diffuse_logprob=-2.0)))
    m = RequestMachine(Request("r", (1, 2, 3), SamplingParams(max_tokens=32, stop=["12 13"])),
                       ["llama-server", "vllm"], [512, 512], frozenset({0}),
                       lambda ids: b"".join(b"%d " % i for i in ids), cfg, StepGuard(cfg.guard))
    visit = RemoteVisit(m)
    visit.await_draft_check(7)
    _feed(visit, [10, 11, 12, 13, 14, 15, 16])  # held: the stop string is not seen until release
    assert m.done is None
    visit.draft_checked()  # releases all but the diffuse hold (3): "12 13" is out
    assert m.done is not None and m.done.finish_reason is FinishReason.STOP and m.done.text == "10 11 "
