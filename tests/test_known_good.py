"""A known-good output on the real bundled model (the habit of llama2.c's test_all.py)."""

from __future__ import annotations

from qladder.ladder import Ladder
from qladder.model import user_prompt_ids
from qladder.sampling import SamplingParams
from qladder.types import FinishReason

from .conftest import get_engine

PROMPT = "Write a haiku about the sea."
# Greedy fp32 answer, recorded with torch 2.13.0 / transformers 5.24.0 on the Q4_1 GGUF.
EXPECTED_IDS = [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082, 282, 260,
                10393, 28, 198, 49, 13151, 282, 260, 6122, 338, 5721, 8823, 28, 198, 49, 13151, 282, 260,
                5065, 506, 1149, 30]
EXPECTED_TEXT = ("The waves of the sea, a silent beauty,\nA gentle lapping of the shore,\n"
                 "A reminder of the beauty that lies beneath,\nA reminder of the ocean's power.")


def test_fp32_greedy_answer_is_the_recorded_one(model_info):
    fp32 = get_engine("fp32")
    ids = user_prompt_ids(model_info.chat_template, PROMPT, fp32.tokenize)
    r = Ladder([fp32]).generate(ids, SamplingParams(max_tokens=48))
    assert r.token_ids == EXPECTED_IDS
    assert r.text == EXPECTED_TEXT
    assert r.finish_reason == FinishReason.STOP


def test_int4_answers_the_capital_question(model_info):
    int4 = get_engine("int4")
    ids = user_prompt_ids(model_info.chat_template, "What is the capital of France? Answer in one sentence.",
                          int4.tokenize)
    r = Ladder([int4]).generate(ids, SamplingParams(max_tokens=40))
    assert r.text == "The capital of France is Paris."
    assert r.finish_reason == FinishReason.STOP
