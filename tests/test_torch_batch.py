"""The batched full-precision rung (engines/torch_batch.py) against the one-session torch engine:
a session alone is bit-identical to transformers' forward; in a batch, within fp32 rounding and
greedy-identical; windows, rollback, peaks and slots behave as a session's should."""

from __future__ import annotations

import pytest
import torch

from qladder.engines.torch_batch import BatchedTorch
from qladder.errors import EngineError
from qladder.model import user_prompt_ids
from qladder.validate.replay import greedy

from .conftest import get_engine

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
           "List three colors.", "What is 12*7?", "Who painted the Mona Lisa? Answer in one sentence, please.",
           "Hi", "Translate 'good morning' into French, Spanish and German."]
# A session's logits in a batch against the same session alone (measured here: ~6e-5 in a logit
# of magnitude ~20, fp32 matmul blocking that depends on the batch's row count).
BATCH_TOL = 1e-3


@pytest.fixture(scope="module")
def batched() -> BatchedTorch:
    e = BatchedTorch(get_engine("fp32"), n_slots=12)
    yield e
    e.close()


def _ids(text: str) -> list[int]:
    from qladder.model import inspect_model

    return user_prompt_ids(inspect_model().chat_template, text, get_engine("fp32").tokenize)


def _alone(engine, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    s = engine.open(ids)
    toks, rows = [], []
    for _ in range(n):
        row = s.logits().clone()
        rows.append(row)
        toks.append(int(row.argmax()))
        s.push(toks[-1])
    s.close()
    return toks, rows


def test_a_session_alone_is_bit_identical_to_transformers(batched):
    ids = _ids(PROMPTS[0])
    ref_toks, ref_rows = _alone(get_engine("fp32"), ids, 12)
    toks, rows = _alone(batched, ids, 12)
    assert toks == ref_toks
    for a, b in zip(ref_rows, rows, strict=True):
        assert torch.equal(a, b)


def test_eight_sessions_in_one_forward_match_each_alone(batched):
    """Prompts of different lengths prefilled together, then decoded together: every session's
    rows equal its rows alone within BATCH_TOL, and its greedy answer is token-identical to the
    validation harness's fp32 greedy loop."""
    n = 12
    prompts = [_ids(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 3
    alone = [_alone(batched, p, n) for p in prompts]
    sessions = [batched.reserve(p) for p in prompts]
    batched.run([(s, s.take_pending(), 1) for s in sessions])
    toks: list[list[int]] = [[] for _ in sessions]
    worst = 0.0
    for step in range(n):
        work = []
        for k, s in enumerate(sessions):
            row = s.logits()
            worst = max(worst, float((row - alone[k][1][step]).abs().max()))
            toks[k].append(int(row.argmax()))
            work.append((s, [toks[k][-1]], 1))
        batched.run(work)
    for s in sessions:
        s.close()
    assert worst < BATCH_TOL, worst
    for k, p in enumerate(prompts):
        assert toks[k] == alone[k][0]
        ref = greedy(get_engine("fp32"), p, n)  # ends at EOS; these loops decode past it
        assert toks[k][:len(ref)] == ref


def test_a_window_gives_every_position_its_row_and_rollback_keeps_the_rest(batched):
    """A verification window [t, d1..dk] gives k + 1 rows equal to decoding them one by one; a
    rollback of the rejected tail leaves a session that decodes on exactly as one never offered them."""
    p = _ids(PROMPTS[2])
    toks, rows = _alone(batched, p, 10)
    s = batched.open(p[:-1])
    batched.run([(s, [p[-1], *toks[:7]], 8)])
    win = s.rows()
    assert win.shape == (8, batched.n_vocab)
    for i in range(8):
        assert float((win[i] - rows[i]).abs().max()) < BATCH_TOL
        assert int(win[i].argmax()) == toks[i]
    s.rollback(4)  # keep p + toks[:3]
    assert s.token_ids == p + toks[:3]
    again = s.logits()
    assert float((again - rows[3]).abs().max()) < BATCH_TOL
    s.push(toks[3])
    assert int(s.logits().argmax()) == toks[4]
    s.close()


def test_peaks_are_each_sessions_own(batched):
    """Activation peaks are per session: a session's peaks in a batch are its peaks alone, not
    its neighbour's, and position 0's massive activation is kept apart in `rest_peaks`."""
    batched.instrument(True, False)
    try:
        a_ids, b_ids = _ids(PROMPTS[0]), _ids(PROMPTS[5])
        a = batched.open(a_ids)
        pa = a.output()
        b = batched.open(b_ids)
        pb = b.output()
        assert pa.peaks is not None and pa.rest_peaks is not None and pa.activation_limit is not None
        assert bool((pa.peaks >= pa.rest_peaks).all())
        assert float(pa.peaks.max()) > 10 * float(pa.rest_peaks.max())  # the attention sink at position 0
        a.push(int(pa.row.argmax()))
        alone_a = a.output().peaks.clone()
        a.rollback(1)
        a.logits()
        batched.run([(a, [int(pa.row.argmax())], 1), (b, [int(pb.row.argmax())], 1)])
        assert torch.allclose(a.output().peaks, alone_a, rtol=1e-4)
        assert not torch.allclose(a.output().peaks, b.output().peaks, rtol=1e-4)
        a.close()
        b.close()
    finally:
        batched.instrument(False, False)


def test_slots_run_out_then_free():
    e = BatchedTorch(get_engine("fp32"), n_slots=2)
    try:
        s1, s2 = e.open([1, 2, 3]), e.open([4, 5])
        with pytest.raises(EngineError):
            e.open([6])
        s1.close()
        s3 = e.open([6])
        assert e.free_slots == 0
        s2.close()
        s3.close()
        assert e.free_slots == 2
        with pytest.raises(EngineError):
            s3.logits()
    finally:
        e.close()
