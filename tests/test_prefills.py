"""The prefill ledger (serving/prefills.py) on a fake clock: what a stream's silence owes to the
prompts its server prefilled meanwhile, and what it does not."""

from __future__ import annotations

import pytest

from qladder.serving.prefills import MARGIN, MIN_RATE_TOKENS, PrefillLedger

from .fakes import Clock


def _measured(clock: Clock, rate: float = 500.0) -> PrefillLedger:
    """A ledger whose server prefilled one 1000-token prompt at `rate` tokens a second."""
    ledger = PrefillLedger(clock, cap_s=30.0)
    k = ledger.begin(1000)
    clock.t += 1000 / rate
    ledger.end(k, answered=True)
    clock.t += 10.0
    return ledger


def test_nothing_is_owed_before_a_rate_is_measured_or_when_nothing_was_prefilled():
    clock = Clock()
    ledger = PrefillLedger(clock, cap_s=30.0)
    ledger.begin(2000)
    assert ledger.owed(clock()) == 0.0 and ledger.rate is None  # the plain deadline until measured
    short = PrefillLedger(clock, cap_s=30.0)
    k = short.begin(MIN_RATE_TOKENS - 1)  # too short to say the rate (the server's overhead)
    clock.t += 1.0
    short.end(k, answered=True)
    assert short.rate is None
    ledger = _measured(clock)
    assert ledger.rate == pytest.approx(500.0) and ledger.owed(clock()) == 0.0


def test_a_prompt_sent_during_the_silence_is_owed_its_whole_prefill():
    clock = Clock()
    ledger = _measured(clock)
    since = clock()
    clock.t += 0.5
    k = ledger.begin(1500)  # another request's prompt joins the server's batch
    assert ledger.owed(since) == pytest.approx(3.0 * MARGIN)  # 1500 tokens at 500/s, while it is open
    clock.t += 3.0  # (at the same rate)
    ledger.end(k, answered=True)
    assert ledger.owed(since) == pytest.approx(3.0 * MARGIN)  # and after its first token, for the same silence
    assert ledger.owed(clock()) == 0.0  # a silence that starts after it owes it nothing


def test_only_the_part_of_a_prefill_inside_the_silence_is_owed():
    clock = Clock()
    ledger = _measured(clock)
    k = ledger.begin(1000)  # 2 s at 500/s: taken to run in the last 2 s before its first token
    clock.t += 2.0
    since = clock() - 0.5  # the stream's last token came 0.5 s before that first token
    ledger.end(k, answered=True)
    assert ledger.owed(since) == pytest.approx(0.5 * MARGIN)
    open_since = clock()
    k2 = ledger.begin(1000)
    clock.t += 1.5  # open for 1.5 s of its 2 s before a silence that starts now
    assert ledger.owed(clock()) == pytest.approx(0.5 * MARGIN)
    assert ledger.owed(open_since) == pytest.approx(2.0 * MARGIN)
    ledger.end(k2, answered=False)  # its stream ended without a token: no rate from it
    assert ledger.rate == pytest.approx(500.0)


def test_what_is_owed_is_capped_and_old_prefills_are_forgotten():
    clock = Clock()
    ledger = PrefillLedger(clock, cap_s=4.0)
    k = ledger.begin(1000)
    clock.t += 2.0
    ledger.end(k, answered=True)  # 500 tokens/s
    since = clock()
    for _ in range(5):
        ledger.begin(2000)  # 4 s each
    assert ledger.owed(since) == 4.0
    clock.t += 500.0
    assert ledger.pending == 5


def test_a_hung_server_owes_nothing_to_prompts_it_never_answers():
    """Prompts that keep arriving at a server that hangs stop counting once overdue: a stream's
    silence there meets the plain deadline again, not the cap."""
    clock = Clock()
    ledger = _measured(clock)  # 500 tokens/s
    since = clock()
    ledger.begin(500)  # 1 s expected
    clock.t += 2.0  # past 1.5 x its expected time, still no first token
    assert ledger.owed(since) == 0.0


def test_a_cached_prompt_answered_at_once_is_owed_only_its_own_short_life():
    clock = Clock()
    ledger = _measured(clock)
    since = clock()
    clock.t += 5.0
    k = ledger.begin(2000)  # 4 s at the rate, but the server's prompt cache answers it in 0.1 s
    clock.t += 0.1
    ledger.end(k, answered=False)
    assert ledger.owed(since) == pytest.approx(0.1 * MARGIN)


def test_done_prompts_that_ended_before_the_silence_owe_nothing_whatever_their_order():
    """owed() walks the done prompts newest first and stops at the first that ended before
    `since`: those before it ended earlier still (the clock only goes forward)."""
    clock = Clock()
    ledger = _measured(clock)  # rate 500/s; its measuring prompt ended 10 s ago
    a = ledger.begin(500)  # 1 s of prefill, ends before the silence
    clock.t += 1.0
    ledger.end(a, answered=False)
    since = clock.t + 0.5
    clock.t = since + 0.5
    b = ledger.begin(250)  # 0.5 s of prefill inside the silence
    clock.t += 0.5
    ledger.end(b, answered=False)
    clock.t += 1.0
    assert ledger.owed(since) == pytest.approx(MARGIN * 0.5)
    assert ledger.owed(clock.t) == 0.0  # nothing since now


def test_a_sent_prompt_measures_the_rate_once_and_a_resent_one_is_prefilled_anew():
    clock = Clock()
    ledger = PrefillLedger(clock, cap_s=30.0)
    sent = ledger.sent(1000)
    assert sent.waiting and ledger.pending == 1
    clock.t += 2.0
    assert sent.answered() and not sent.waiting and ledger.rate == pytest.approx(500.0)
    clock.t += 1.0
    assert not sent.answered() and ledger.rate == pytest.approx(500.0)  # later tokens measure nothing
    sent.resent(2000)  # its replica died: the sibling prefills the whole context again
    assert sent.waiting and ledger.pending == 1
    since = clock()
    clock.t += 1.0
    assert ledger.owed(since) == pytest.approx(MARGIN * 4.0)  # sent in the silence: its whole 4 s
    sent.close()
    sent.close()  # idempotent: a stream ends however it ends
    assert ledger.pending == 0 and ledger.rate == pytest.approx(500.0)  # closed unanswered: no rate
