"""The engine contract (tests/test_engines_contract.py), clause by clause, on the engine the INT4
scheduler owns: `BatchedLlamaCpp`, whose interface is slots rather than sessions (a slot's
`decode` / `row` / `truncate` stand for a session's push / logits / rollback). Its rows must
be the rows the per-request llama.cpp engine gives on the same GGUF, whatever else shares the
batch, and what `decode(row_stats=, monitor=)` fills must be what the scheduler reads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from qladder.engines.llamacpp_batch import BatchedLlamaCpp, Entry
from qladder.errors import EngineError
from qladder.model import user_prompt_ids

from .conftest import get_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batched(model_info, settings) -> Iterator[BatchedLlamaCpp]:
    e = BatchedLlamaCpp(model_info, n_slots=3, n_ctx=512, n_threads=1, native_dir=settings.cache_dir)
    yield e
    e.close()


def _prompt(model_info, engine, text: str = "Name three colors.") -> list[int]:
    return user_prompt_ids(model_info.chat_template, text, engine.tokenize)


def _greedy(e: BatchedLlamaCpp, slot: int, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `prompt` into a free slot, then n greedy steps; the tokens and each step's row."""
    e.truncate(slot, 0)
    e.decode([Entry(slot, prompt, 0)])
    toks, rows = [], []
    for i in range(n):
        row = e.row(slot).clone()
        rows.append(row)
        toks.append(int(row.argmax()))
        assert e.argmax(slot) == toks[-1]  # the native argmax the scheduler takes is torch's
        e.decode([Entry(slot, [toks[-1]], len(prompt) + i)])
    return toks, rows


def test_rows_are_the_vocabulary_wide_float32_rows_of_the_per_request_engine(batched, model_info):
    """Logits shape and values: a slot's rows equal LlamaCppEngine's on the same ids."""
    p = _prompt(model_info, batched)
    toks, rows = _greedy(batched, 0, p, 6)
    s = get_engine("int4").open(p)
    try:
        for t, row in zip(toks, rows, strict=True):
            assert row.dtype == torch.float32 and row.shape == (batched.n_vocab,)
            assert bool(torch.isfinite(row).all())
            assert torch.equal(row, s.logits())
            s.push(t)
    finally:
        s.close()
    assert batched.fingerprint == get_engine("int4").fingerprint


def test_a_slot_decoded_beside_others_gets_the_rows_it_gets_alone(batched, model_info):
    """The scheduler's premise: one KV stream per slot, so the batch does not change a row."""
    a, b = _prompt(model_info, batched), _prompt(model_info, batched, "Write a haiku about rain.")
    alone, rows_alone = _greedy(batched, 0, a, 5)
    batched.truncate(0, 0)
    batched.truncate(1, 0)
    batched.decode([Entry(0, a, 0)])
    batched.decode([Entry(1, b, 0)])
    nb = len(b)
    for i in range(5):
        row0 = batched.row(0).clone()
        assert torch.equal(row0, rows_alone[i])
        t1 = batched.argmax(1)
        batched.decode([Entry(0, [alone[i]], len(a) + i), Entry(1, [t1], nb + i)])


def test_truncate_is_a_rollback_that_replays_bit_identical(batched, model_info):
    p = _prompt(model_info, batched)
    toks, rows = _greedy(batched, 2, p, 6)
    batched.truncate(2, len(p) + 1)  # back to just after token 2 was pushed: the last kept id is
    batched.decode([Entry(2, [toks[1]], len(p) + 1)])  # evaluated again for its row
    again = []
    for i in range(2, 6):
        row = batched.row(2).clone()
        assert torch.equal(row, rows[i]), "logits after rollback differ"
        again.append(int(row.argmax()))
        batched.decode([Entry(2, [again[-1]], len(p) + i)])
    assert again == toks[2:]


def test_greedy_decode_is_deterministic(batched, model_info):
    p = _prompt(model_info, batched)
    assert _greedy(batched, 0, p, 8)[0] == _greedy(batched, 1, p, 8)[0]


def test_the_step_output_fields_are_filled_as_decode_is_asked(batched, model_info):
    """row_stats=True: (sum, max, min) of the row, computed with its copy; monitor=True: the
    per-layer peaks, the ones away from position 0 never above them. Not asked: not filled."""
    assert batched.has_native, batched.native_error  # make install has a C compiler: they build
    p = _prompt(model_info, batched)
    batched.truncate(0, 0)
    batched.decode([Entry(0, p, 0)], monitor=True, row_stats=True)
    row, stats = batched.row(0), batched.row_stats(0)
    assert stats is not None
    total, hi, lo = stats
    assert hi == float(row.max()) and lo == float(row.min())
    assert total == pytest.approx(float(row.double().sum()), rel=1e-5, abs=1e-2)
    peaks, rest = batched.peaks(0)
    assert peaks.shape == (batched.n_layer,) and bool((peaks > 0).all()) and bool((peaks >= rest).all())
    batched.decode([Entry(0, [int(row.argmax())], len(p))], monitor=False, row_stats=False)
    assert batched.row_stats(0) is None


def test_a_full_slot_is_an_engine_error_and_keeps_what_it_had(batched, model_info):
    p = _prompt(model_info, batched)
    batched.truncate(1, 0)
    batched.decode([Entry(1, p, 0)])
    before = batched.row(1).clone()
    with pytest.raises(EngineError):
        batched.decode([Entry(1, [1] * 8, batched.n_ctx - 4)])
    batched.truncate(1, len(p) - 1)  # the slot still holds the prompt: its last id again, same row
    batched.decode([Entry(1, [p[-1]], len(p) - 1)])
    assert torch.equal(batched.row(1), before)


def test_detokenize_bytes_agrees_with_the_per_request_engine(batched):
    ids = batched.tokenize("Hola 😊🌍 · naïve — 東京 <|im_end|>", True)
    assert batched.detokenize_bytes(ids) == get_engine("int4").detokenize_bytes(ids)
    assert batched.detokenize_bytes(ids).decode("utf-8") == batched.detokenize(ids)


def test_a_prompt_prefilled_in_chunks_carries_its_peaks_to_the_last_chunk(batched, model_info):
    """The INT4 scheduler prefills a long prompt in chunks and judges only the last chunk's row:
    with `carry_peaks` on every chunk after the first, the peaks read then are those of every
    position of the prompt, as a prefill at once gives them (position 0's massive activation
    included); without it, only the last chunk's."""
    assert batched.has_native, batched.native_error
    p = _prompt(model_info, batched, "Summarize the plot of a long novel about a lighthouse keeper, "
                                     "his daughter and the storm that changed their island, in detail.")
    k = 16
    assert len(p) > 2 * k
    batched.truncate(0, 0)
    batched.decode([Entry(0, p, 0)], monitor=True)
    whole = [t.clone() for t in batched.peaks(0)]

    def chunked(carry: bool) -> list[torch.Tensor]:
        batched.truncate(0, 0)
        for i in range(0, len(p), k):
            last = i + k >= len(p)
            batched.decode([Entry(0, p[i:i + k], i, logits=last, carry_peaks=carry and i > 0)], monitor=True)
        return [t.clone() for t in batched.peaks(0)]

    carried, alone = chunked(True), chunked(False)
    for c, w in zip(carried, whole, strict=True):  # the same positions, chunked matmuls: close, not bit-equal
        assert torch.allclose(c, w, rtol=1e-2, atol=1e-2)
    assert bool((alone[0] <= carried[0] * (1 + 1e-2)).all())
    assert float(carried[0].max()) > 4 * float(alone[0].max())  # the first chunk held the biggest peak
