"""A remote rung for real: llama.cpp's llama-server (built by make install) as rung 0 of the
ladder, its streamed tokens judged one by one, handed off by token ids to the in-process fp32
standby. Its faults are real: a GGUF copy with one Q4_1 block scale set to inf makes llama-server
answer "......" with 200 OK and null logprobs; the server is killed mid-stream."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from qladder.model import user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.sampling import SamplingParams
from qladder.serving import ServingConfig, ServingEngine
from qladder.testing.faults import parse_fault
from qladder.types import FinishReason
from qladder.validate.replay import greedy

from .conftest import get_engine, live_app

pytestmark = pytest.mark.slow
PROMPT = "Name three colors."


@pytest.fixture(scope="module")
def servers(model_info, inf_scale_gguf):
    bad = inf_scale_gguf
    good_server = LlamaServer(model_info.path, n_parallel=4, threads=1, n_ctx_per_slot=1024).start()
    bad_server = LlamaServer(bad, n_parallel=2, threads=1, n_ctx_per_slot=1024).start()
    yield good_server, bad_server
    good_server.stop()
    bad_server.stop()


def _engine(url):
    return ServingEngine(ServingConfig(remote_url=url, allow_faults=True), standby_engines=[get_engine("fp32")])


def _ids(se, text=PROMPT):
    return user_prompt_ids(se.info.chat_template, text, se.int4.tokenize)


def _fp32_greedy(ids, n):
    return greedy(get_engine("fp32"), ids, n)  # the validation harness's naive greedy loop


def test_the_dot_flood_of_a_nan_row_becomes_a_clean_answer_on_fp32(servers):
    _, bad = servers
    se = _engine(bad.base_url)
    try:
        ids = _ids(se)
        straight = httpx.post(f"{bad.base_url}/completion", timeout=60,
                              json={"prompt": ids, "n_predict": 8, "temperature": 0}).json()
        assert straight["content"] == "." * 8  # the garbage a client gets from the bare server
        r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24)))
    finally:
        se.close()
    assert [(h.check, h.rung, h.step) for h in r.hazards] == [("nonfinite", "llama-server", 0)]
    assert r.handoffs[0].from_rung == "llama-server" and r.handoffs[0].to_rung == "fp32"
    assert set(r.token_rungs) == {"fp32"} and "." not in r.text[:1] and r.text.strip()
    assert r.token_ids == _fp32_greedy(ids, 24)[:len(r.token_ids)] and r.finish_reason in (
        FinishReason.STOP, FinishReason.LENGTH)


def test_a_healthy_remote_rung_answers_like_in_process_int4_and_hands_off_by_ids(servers):
    good, _ = servers
    se = _engine(good.base_url)
    try:
        ids = _ids(se)
        clean = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24)))
        faulted = se.generate_sync(se.request(ids, SamplingParams(max_tokens=24),
                                              faults=[parse_fault("nan@step=3")]))
    finally:
        se.close()
    local = ServingEngine(ServingConfig(slots=1, standby_rungs=()))
    try:
        ours = local.generate_sync(local.request(ids, SamplingParams(max_tokens=24)))
    finally:
        local.close()
    assert clean.text == ours.text and clean.hazards == [] and set(clean.token_rungs) == {"llama-server"}
    assert faulted.token_rungs[:3] == ["llama-server"] * 3 and set(faulted.token_rungs[3:]) == {"fp32"}
    assert faulted.token_ids[:3] == clean.token_ids[:3]
    assert faulted.token_ids[3:] == _fp32_greedy(ids + clean.token_ids[:3], 21)[:len(faulted.token_ids) - 3]


def test_a_server_killed_mid_stream_ends_every_request_on_the_standby(model_info):
    server = LlamaServer(model_info.path, n_parallel=4, threads=1, n_ctx_per_slot=1024).start()
    se = _engine(server.base_url)
    try:
        ids = _ids(se, "Write a long story about a dragon who learns to bake bread.")
        results: list = [None] * 3

        def run(k):
            results[k] = se.generate_sync(se.request(ids, SamplingParams(max_tokens=100)))

        threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while se.scheduler.steps < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.kill()  # mid-stream
        for t in threads:
            t.join(180)
        assert not se.scheduler.healthy
        after = se.generate_sync(se.request(_ids(se), SamplingParams(max_tokens=8)))
    finally:
        server.stop()
        se.close()
    for r in results:
        assert r is not None and r.hazards[0].check == "engine_error" and r.hazards[0].rung == "llama-server"
        assert r.handoffs and r.token_rungs[-1] == "fp32" and not r.fallback
    assert set(after.token_rungs) == {"fp32"} and after.handoffs == []  # straight to the standby meanwhile


def test_qladder_serve_in_front_of_a_broken_llama_server_streams_a_clean_answer(servers, tmp_path):
    import dataclasses

    import openai

    from qladder.server.serve import build_server
    from qladder.server.topology import PoolConfig, Topology

    _, bad = servers
    t = Topology()
    pools = (PoolConfig("edge", ("llama-server",), slots=2, weight=1.0, handoff_to="standby", url=bad.base_url),
             PoolConfig("standby", ("fp32",), sessions=2))
    t = dataclasses.replace(t, pools=pools, server=dataclasses.replace(t.server, incidents=str(tmp_path / "i.db")))
    server = build_server(t, standby_engines=[get_engine("fp32")])
    try:
        with live_app(server.app) as base, openai.OpenAI(base_url=base, api_key="none", max_retries=0) as c:
            chunks = list(c.chat.completions.create(model="smollm2-135m-instruct", stream=True, max_tokens=24,
                                                    temperature=0, messages=[{"role": "user", "content": PROMPT}]))
        pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
        ext = chunks[-1].model_extra["qladder"]
        deadline = time.monotonic() + 10
        while server.store.count() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = server.store.rows(10)
    finally:
        server.close()
    text = "".join(pieces)
    assert not text.startswith(".") and text.strip()  # no '.' of the bad stream was forwarded
    assert [(h["check"], h["rung"]) for h in ext["hazards"]] == [("nonfinite", "llama-server")]
    assert ext["handoffs"][0]["to_rung"] == "fp32" and set(ext["tokens_per_rung"]) == {"fp32"}
    assert len(rows) == 1 and rows[0]["rung"] == "llama-server" and rows[0]["action"] == "handoff:fp32"


def test_ids_llama_server_leaves_out_of_its_stream_are_caught_and_the_answer_continues_from_the_last_known(
        servers):
    """While an emoji's bytes span tokens, llama-server streams only the id of the token that
    completes it (the non-streaming answer has them all): the chunk's text is not its token's."""
    good, _ = servers
    se = _engine(good.base_url)
    try:
        ids = _ids(se, "👨‍💻👨‍💻👨‍💻 what is this?")
        every = httpx.post(f"{good.base_url}/completion", timeout=60, json={
            "prompt": ids, "n_predict": 12, "temperature": 0, "return_tokens": True}).json()["tokens"]
        r = se.generate_sync(se.request(ids, SamplingParams(max_tokens=12)))
    finally:
        se.close()
    assert r.hazards and r.hazards[0].check == "mismatch" and r.hazards[0].rung == "llama-server"
    k = r.token_rungs.count("llama-server")
    assert r.token_ids[:k] == every[:k] and k < len(every)  # only ids the server really sampled, in order
    assert set(r.token_rungs[k:]) == {"fp32"} and r.token_ids[k:] == _fp32_greedy(ids + every[:k], 12 - k)[
        :len(r.token_ids) - k]


def test_a_server_whose_vocabulary_differs_is_refused_at_start(model_info, tmp_path):
    """A real llama-server on a copy of the GGUF with two token strings swapped: the rung's probe
    texts tokenize differently there, so handing ids across would change the text."""
    from qladder.engines.llamacpp import LlamaVocab
    from qladder.engines.remote_llama import LlamaServerRung
    from qladder.errors import TokenizerMismatchError
    from qladder.testing.gguf_patch import swapped_vocab_gguf

    vocab = LlamaVocab(model_info)
    hello, world = vocab.tokenize("Hello", False)[0], vocab.tokenize(" world", False)[0]
    vocab.close()
    other = swapped_vocab_gguf(model_info.path, tmp_path / "swapped.gguf", hello, world)
    assert other["swapped"] == [hello, world]
    with LlamaServer(tmp_path / "swapped.gguf", n_parallel=1, threads=1, n_ctx_per_slot=512) as ls:
        with pytest.raises(TokenizerMismatchError, match="tokenizes 'Hello, world!'"):
            LlamaServerRung(model_info, ls.base_url)
        assert httpx.get(f"{ls.base_url}/health").status_code == 200  # the server itself is fine
