"""Quantization levels (qladder.levels) and the INT8 rung they give: llama.cpp's quantizer on the
embedded model's full-precision weights, and a handoff INT4 -> INT8 -> FP32 that continues by ids."""

from __future__ import annotations

import os

import numpy as np
import pytest

from qladder.errors import ConfigError
from qladder.ladder import Ladder
from qladder.levels import LEVELS, describe, full_precision_gguf, level_gguf, level_name
from qladder.model import inspect_model, user_prompt_ids
from qladder.sampling import SamplingParams
from qladder.testing.faults import parse_fault

from .conftest import get_engine


def test_the_full_precision_copy_holds_the_dequantized_weights(model_info, settings):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    f32 = full_precision_gguf(model_info, settings.cache_dir)
    assert inspect_model(f32, settings.cache_dir).file_type == 0  # ALL_F32
    src = {t.name: t for t in GGUFReader(str(model_info.path)).tensors}
    out = {t.name: t for t in GGUFReader(str(f32)).tensors}
    assert out.keys() == src.keys() and {t.tensor_type.name for t in out.values()} == {"F32"}
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):  # a Q4_1 tensor, the Q8_0 embeddings
        assert src[name].tensor_type.name != "F32"
        assert np.array_equal(np.asarray(out[name].data), dequantize(src[name].data, src[name].tensor_type))


def test_q8_0_is_llama_cpps_quantization_and_is_made_once(model_info, settings):
    path = level_gguf(model_info, "Q8_0", settings.cache_dir)
    first = path.stat().st_mtime_ns
    d = describe("Q8_0", path)
    assert set(d.tensor_types) == {"Q8_0", "F32"}  # the norms stay F32, as llama.cpp keeps 1-D tensors
    assert d.tensor_types["Q8_0"] > 200 and 8.4 < d.bits_per_weight < 8.6, d
    assert level_name(inspect_model(path, settings.cache_dir).file_type) == "Q8_0"
    assert level_gguf(model_info, "Q8_0", settings.cache_dir) == path and path.stat().st_mtime_ns == first
    assert not list(path.parent.glob("*.part"))  # no temporary file left behind


def test_an_unknown_level_is_a_config_error(model_info, settings):
    with pytest.raises(ConfigError, match=r"unknown quantization level 'Q9_9'.*Q8_0"):
        level_gguf(model_info, "Q9_9", settings.cache_dir)
    assert "Q2_K" in LEVELS and level_name(3) == "Q4_1" and level_name(99) == "file type 99"


def _chat(engine, text: str = "What is the capital of France?") -> list[int]:
    return user_prompt_ids(inspect_model().chat_template, text, engine.tokenize)


def test_int8_continues_an_int4_prefix_as_its_own_context():
    """The handoff's invariant on the INT8 rung: an INT4 prefix handed over as ids gives INT8's own
    rows for those ids (bit-identical to opening on them), and INT8 is not INT4."""
    int4, int8 = get_engine("int4"), get_engine("int8")
    assert int8.name == "int8" and int8.fingerprint == int4.fingerprint and "Q8_0" in int8.precision
    p = _chat(int4)
    s = int4.open(p)
    toks = []
    for _ in range(8):
        toks.append(int(s.logits().argmax()))
        s.push(toks[-1])
    s.close()
    handed = int8.open(p)
    handed.extend(toks)
    row = handed.logits().clone()
    handed.close()
    direct = int8.open(p + toks)
    assert (row - direct.logits()).abs().max().item() <= 1e-4
    direct.close()
    s = int4.open(p + toks)
    assert not bool((s.logits() == row).all())  # another file's numbers
    s.close()


def test_a_hazard_climbs_int4_to_int8_and_int8_as_rung_0_climbs_to_fp32():
    int4, int8, fp32 = get_engine("int4"), get_engine("int8"), get_engine("fp32")
    p = _chat(int4)
    r = Ladder([int4, int8, fp32]).generate(p, SamplingParams(max_tokens=12), faults=[parse_fault("nan@step=4")])
    assert r.token_rungs[:4] == ["int4"] * 4 and r.token_rungs[4:] == ["int8"] * (len(r.token_ids) - 4)
    assert r.handoffs[0].to_rung == "int8" and len(r.token_ids) > 6
    # token-exact: the INT8 part is INT8's own greedy continuation of the INT4 prefix
    s = int8.open(p + r.token_ids[:4])
    cont = []
    for _ in range(len(r.token_ids) - 4):
        cont.append(int(s.logits().argmax()))
        s.push(cont[-1])
    s.close()
    assert r.token_ids[4:] == cont[: len(r.token_ids) - 4]
    # INT8 as a ladder's first rung (a pool's): its hazard climbs to fp32, token-exact there too
    r2 = Ladder([int8, fp32]).generate(p, SamplingParams(max_tokens=8), faults=[parse_fault("nan@step=3")])
    assert r2.token_rungs == ["int8"] * 3 + ["fp32"] * (len(r2.token_ids) - 3) and r2.handoffs[0].to_rung == "fp32"


def test_the_serving_engine_hands_int4_off_to_an_int8_standby_rung_first(model_info, settings):
    """`qladder generate --ladder int4,int8,fp32`'s path: the serving engine's standby runs int8 then
    fp32; a NaN row at step 3 climbs to int8, which continues the answer from the same ids."""
    from qladder.engines.torch_batch import BatchedTorch
    from qladder.serving import ServingConfig, ServingEngine

    int8, fp32 = get_engine("int8"), get_engine("fp32")
    se = ServingEngine(ServingConfig(slots=1, allow_faults=True, audit_rate=1.0), model_info, settings,
                       standby_engines=[int8, fp32])
    try:
        p = _chat(se.int4)
        r = se.generate_sync(se.request(p, SamplingParams(max_tokens=10), faults=[parse_fault("nan@step=3")]))
        # the audit scores with full precision (rung 2 here), and verified decoding is not int8's
        assert se.auditor is not None and se.standby is not None
        assert isinstance(se.auditor.engine, BatchedTorch) and se.auditor.engine is se.standby.engines[2]
        assert not se.verifies
    finally:
        se.close()
    assert se.rungs == ["int4", "int8", "fp32"]
    assert r.token_rungs[:3] == ["int4"] * 3 and set(r.token_rungs[3:]) == {"int8"}, r.token_rungs
    s = int8.open(p + list(r.token_ids[:3]))
    cont = []
    for _ in range(len(r.token_ids) - 3):
        cont.append(int(s.logits().argmax()))
        s.push(cont[-1])
    s.close()
    assert list(r.token_ids[3:]) == cont


def test_the_quantizers_own_stderr_goes_to_the_levels_log_and_comes_back(tmp_path):
    """llama.cpp's quantizer writes each fallback to file descriptor 2, past its log callback:
    `_stderr_to` sends that descriptor to the level's log for the call and restores it after."""
    from qladder.levels import _stderr_to

    before = os.fstat(2)
    log = tmp_path / "Q2_K.quantize.log"
    with _stderr_to(log):
        os.write(2, b"warning: blk.0.attn_k.weight - falling back to q4_0\n")
    after = os.fstat(2)
    assert log.read_bytes() == b"warning: blk.0.attn_k.weight - falling back to q4_0\n"
    assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)
