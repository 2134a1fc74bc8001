"""qladder serve in front of two real serving engines: llama.cpp's llama-server (the INT4 pool, on
the embedded GGUF or a copy with one block scale set to inf) and vLLM's OpenAI server (the
full-precision standby, on the fp32 folder), both started by the tests, driven with the official
`openai` client. No server's output is mocked: the faults are a corrupted GGUF and a killed process."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from qladder.model import user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.server.breaker import BreakerConfig
from qladder.server.serve import Server, build_server
from qladder.server.topology import remote_topology
from qladder.serving.remote_verified import NO_PROGRESS
from qladder.validate.corpora import load_corpora

from .conftest import live_app

pytestmark = pytest.mark.slow
PROMPT = "Name three colors."
MODEL = "smollm2-135m-instruct"


@contextlib.contextmanager
def serving(llama_url: str, vllm_url: str | tuple[str, ...], tmp_path, breaker: BreakerConfig | None = None,
            **server: object) -> Iterator[tuple[Server, str]]:
    t = remote_topology(llama_url, vllm_url, incidents=str(tmp_path / "incidents.db"), **server)
    if breaker is not None:
        t = dataclasses.replace(t, breaker=breaker)
    server = build_server(t)
    try:
        with live_app(server.app) as base:
            yield server, base
    finally:
        server.close()


def _wait(pred, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(pred())


def _stream(base: str, text: str, max_tokens: int) -> tuple[str, dict, str]:
    with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300) as c:
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, stream=True, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": text}])
        chunks = list(raw.parse())
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    return "".join(pieces), chunks[-1].model_extra["qladder"], raw.headers.get("x-qladder-route", "")


def test_the_dot_flood_of_llama_server_becomes_a_clean_answer_continued_on_vllm(
        model_info, inf_scale_gguf, vllm_server, tmp_path):
    with LlamaServer(inf_scale_gguf, n_parallel=2, threads=1, n_ctx_per_slot=1024) as bad, \
            serving(bad.base_url, vllm_server.base_url, tmp_path) as (server, base):
        ids = user_prompt_ids(model_info.chat_template, PROMPT, server.vocab.tokenize)
        straight = httpx.post(f"{bad.base_url}/completion", timeout=60,
                              json={"prompt": ids, "n_predict": 8, "temperature": 0, "n_probs": 3}).json()
        reference = httpx.post(f"{vllm_server.base_url}/v1/completions", timeout=120, json={
            "model": "fp32", "prompt": ids, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["text"]
        text, ext, _ = _stream(base, PROMPT, 24)
        assert _wait(lambda: server.store.count() >= 1, 10)
        rows = server.store.rows(10)
    assert straight["content"] == "." * 8  # the garbage a client of the bare server gets, with 200 OK
    probs = straight["completion_probabilities"]
    assert len(probs) == 8 and all(p["logprob"] is None for p in probs)  # and nothing in it says so
    assert [(h["check"], h["rung"], h["step"]) for h in ext["hazards"]] == [("nonfinite", "llama-server", 0)]
    assert ext["handoffs"][0]["from_rung"] == "llama-server" and ext["handoffs"][0]["to_rung"] == "vllm"
    assert set(ext["tokens_per_rung"]) == {"vllm"} and not ext["fallback"]
    assert text == reference and not text.startswith(".")  # vLLM's own greedy answer; no '.' forwarded
    assert len(rows) == 1 and rows[0]["rung"] == "llama-server" and rows[0]["action"] == "handoff:vllm"


def test_a_killed_llama_server_ends_on_vllm_opens_the_breaker_and_half_open_probes_close_it_after_restart(
        model_info, vllm_server, tmp_path, monkeypatch):
    # The kill is the only fault here: the step deadline is put out of reach, so that a 2 s gap on a
    # busy 2-core box (a CI run saw one) cannot hand an answer up before the kill does.
    from qladder.health.guard import GUARD_PRESETS
    monkeypatch.setitem(GUARD_PRESETS, "default",
                        dataclasses.replace(GUARD_PRESETS["default"], step_deadline_s=120.0))
    breaker = BreakerConfig(window_s=60, min_requests=3, max_error_rate=0.2, open_s=2.0, probes=2)
    ls = LlamaServer(model_info.path, n_parallel=4, threads=1, n_ctx_per_slot=1024).start()
    try:
        with serving(ls.base_url, vllm_server.base_url, tmp_path, breaker) as (server, base):
            story = "Write a long story about a dragon who learns to bake bread."
            with cf.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(_stream, base, story, 120) for _ in range(4)]
                assert _wait(lambda: server.engine.stats()["steps"] >= 24, 60)  # all four are streaming
                ls.proc.kill()  # mid-stream
                ls.stop()  # reaped
                answers = [f.result(timeout=300) for f in futures]
            breakers = server.gateway.breakers
            assert str(breakers["edge"].mode) == "open"
            _, during, route = _stream(base, PROMPT, 8)  # while it is away: straight to vLLM
            assert set(during["tokens_per_rung"]) == {"vllm"} and not during["handoffs"]
            assert route in ("down:edge", "breaker:edge")
            ls = LlamaServer(model_info.path, n_parallel=4, threads=1, n_ctx_per_slot=1024, port=ls.port).start()
            assert _wait(lambda: server.engine.ready, 30)  # the pool's /health probe saw it back
            time.sleep(breaker.open_s)
            after = [_stream(base, PROMPT, 8) for _ in range(breaker.probes + 1)]
            metrics = httpx.get(base.removesuffix("/v1") + "/metrics").text
            assert str(breakers["edge"].mode) == "closed"
    finally:
        ls.stop()
    for text, ext, _ in answers:
        assert text.strip() and not ext["fallback"]
        assert ext["hazards"][0]["check"] == "engine_error" and ext["hazards"][0]["rung"] == "llama-server"
        assert ext["handoffs"][0]["to_rung"] == "vllm" and "vllm" in ext["tokens_per_rung"]
    assert all(set(ext["tokens_per_rung"]) == {"llama-server"} for _, ext, _ in after[:breaker.probes])
    for to in ("open", "half_open", "closed"):
        assert f'qladder_breaker_transitions_total{{pool="edge",to="{to}"}}' in metrics


def test_glitch_tokens_first_tokens_are_refused_by_vllm_and_the_answer_continues_there(
        model_info, vllm_server, tmp_path):
    """On the glitch-token copy an emoji prompt answers 'This\n&&&&...' with confident logprobs: no
    check of the stream says so until the loop is long. vLLM scores the held draft (one prefill);
    the first token it finds far less likely is refused, and the answer continues on vLLM from
    the tokens before it. Nothing refused is forwarded."""
    from qladder.testing.gguf_patch import glitch_gguf

    emoji = next(p.prompt for p in load_corpora()[1] if p.id == "a-emoji_zwj-001")  # a ZWJ chain
    bad = tmp_path / "glitch.gguf"
    glitch_gguf(model_info.path, bad, x=1000.0)
    with LlamaServer(bad, n_parallel=2, threads=1, n_ctx_per_slot=1024) as ls, \
            serving(ls.base_url, vllm_server.base_url, tmp_path) as (server, base):
        ids = server.gateway.preparer.encode_messages([{"role": "user", "content": emoji}], 24)[0]
        straight = httpx.post(f"{ls.base_url}/completion", timeout=60, json={  # a fresh evaluation, as the
            "prompt": ids, "n_predict": 16, "temperature": 0, "return_tokens": True, "cache_prompt": False})
        straight = straight.json()  # gateway's first request is (x1000 embeddings make near-ties flip)
        text, ext, _ = _stream(base, emoji, 24)
        draft = [int(t) for t in straight["tokens"]]
        refused = ext["hazards"][0]
        kept = draft[:refused["step"]]
        reference = httpx.post(f"{vllm_server.base_url}/v1/completions", timeout=120, json={
            "model": "fp32", "prompt": ids + kept, "max_tokens": 24 - len(kept), "temperature": 0,
            "return_token_ids": True, "skip_special_tokens": False}).json()["choices"][0]
        stats = server.engine.stats()
        theirs = [t for t in reference["token_ids"] if t not in server.vocab.eos_ids]
        bare_text, expected = server.vocab.detokenize(draft), server.vocab.detokenize(kept + theirs)
    assert "&&&&" in bare_text  # the bare server's answer: a flood of '&'
    assert (refused["check"], refused["rung"]) == ("verify", "llama-server") and refused["step"] < 8
    assert ext["handoffs"][0]["to_rung"] == "vllm" and not ext["fallback"]
    assert ext["tokens_per_rung"].get("llama-server", 0) == len(kept)
    # nothing refused was forwarded (and a trailing partial character never is)
    assert text == expected.removesuffix("\ufffd")
    assert stats["drafts_refused"] == 1 and stats["drafts_passed"] == 0


def _verified_stream(base: str, text: str, max_tokens: int, precision: str, temperature: float = 0.0):
    with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300) as c:
        chunks = list(c.chat.completions.create(
            model=MODEL, stream=True, max_tokens=max_tokens, temperature=temperature, seed=7,
            messages=[{"role": "user", "content": text}], extra_body={"qladder": {"precision": precision}}))
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    return "".join(pieces), chunks[-1].model_extra["qladder"]


def _vllm_greedy(vllm_url: str, ids: list[int], n: int) -> str:
    return httpx.post(f"{vllm_url}/v1/completions", timeout=120, json={
        "model": "fp32", "prompt": ids, "max_tokens": n, "temperature": 0}).json()["choices"][0]["text"]


def test_verified_decoding_over_llama_server_and_vllm_streams_vllms_greedy_answer(model_info, vllm_server, tmp_path):
    """"qladder": {"precision": "verified"} through qladder serve over real llama-server (drafts)
    and vLLM (decides): the streamed answer is vLLM's own greedy answer, with most tokens drafted by
    llama-server and kept; the same request without it is llama-server's (INT4's) answer."""
    prompts = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")
    with LlamaServer(model_info.path, n_parallel=4, threads=1, n_ctx_per_slot=1024) as ls, \
            serving(ls.base_url, vllm_server.base_url, tmp_path) as (server, base):
        verified = [_verified_stream(base, p, 40, "verified") for p in prompts]
        fast = _verified_stream(base, prompts[0], 40, "fast")
        ids = [user_prompt_ids(model_info.chat_template, p, server.vocab.tokenize) for p in prompts]
        refs = [_vllm_greedy(vllm_server.base_url, i, 40) for i in ids]
        int4 = httpx.post(f"{ls.base_url}/completion", timeout=60, json={
            "prompt": ids[0], "n_predict": 40, "temperature": 0}).json()["content"]
        sampled = _verified_stream(base, prompts[1], 16, "verified", temperature=0.8)
        stats = server.engine.remote.verified
    for (text, ext), ref in zip(verified, refs, strict=True):
        assert text == ref and not ext["fallback"] and ext["hazards"] == []
        assert set(ext["tokens_per_rung"]) == {"vllm"}  # the rung that decides every token
    assert "Paris" in verified[0][0] and fast[0] == int4 != verified[0][0]  # INT4's own answer without it
    assert stats["windows"] >= len(prompts) and stats["stood"] >= stats["drafted"] // 2 > 0  # drafts do stand
    assert sampled[0] and set(sampled[1]["tokens_per_rung"]) == {"vllm"}  # sampled: vLLM's alone


def test_verified_decoding_with_vllm_replicas_as_the_standby_is_vllms_greedy_answer(model_info, vllm_server,
                                                                                    tmp_path):
    """The standby pool as `urls` (two endpoints on the one vLLM here: by 127.0.0.1 and by
    localhost): the verifier is a pool of replicas, and each window's verdict comes from one of them."""
    prompt = "What is the capital of France?"
    urls = (vllm_server.base_url, vllm_server.base_url.replace("127.0.0.1", "localhost"))
    with LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024) as ls, \
            serving(ls.base_url, urls, tmp_path) as (server, base):
        text, ext = _verified_stream(base, prompt, 32, "verified")
        ids = user_prompt_ids(model_info.chat_template, prompt, server.vocab.tokenize)
        stats = server.engine.stats()
    assert text == _vllm_greedy(vllm_server.base_url, ids, 32) and ext["hazards"] == [] and not ext["fallback"]
    assert set(ext["tokens_per_rung"]) == {"vllm"} and stats["verified_windows"] >= 1
    assert stats["standby_endpoints"] == 2 and stats["standby_endpoints_healthy"] == 2


def test_verified_decoding_over_a_corrupted_llama_server_is_still_vllms_answer(model_info, inf_scale_gguf,
                                                                             vllm_server, tmp_path):
    """Every draft of the inf-scale copy fails the guard (null logprobs): each is a rejected draft,
    recorded; after a few windows without progress vLLM writes the rest alone. The answer is vLLM's."""
    with LlamaServer(inf_scale_gguf, n_parallel=2, threads=1, n_ctx_per_slot=1024) as bad, \
            serving(bad.base_url, vllm_server.base_url, tmp_path) as (server, base):
        text, ext = _verified_stream(base, PROMPT, 24, "verified")
        ids = user_prompt_ids(model_info.chat_template, PROMPT, server.vocab.tokenize)
        ref = _vllm_greedy(vllm_server.base_url, ids, 24)
        stats = server.engine.stats()
    assert text == ref and "." not in text[:1] and not ext["fallback"]
    assert ext["hazards"] and {(h["check"], h["rung"]) for h in ext["hazards"]} == {("nonfinite", "llama-server")}
    # no draft stands: after NO_PROGRESS windows vLLM writes the rest alone (not one window a token)
    assert len(ext["hazards"]) == stats["verified_windows"] == NO_PROGRESS


def _stream_chunks(base: str, text: str, max_tokens: int) -> tuple[str, list[int], dict]:
    """A greedy streamed answer: its text, the tokens each content chunk carried, the extension."""
    with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300) as c:
        chunks = list(c.chat.completions.create(model=MODEL, stream=True, max_tokens=max_tokens, temperature=0,
                                                logprobs=True, messages=[{"role": "user", "content": text}]))
    content = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].delta.content]
    sizes = [len(ch.logprobs.content) for ch in content if ch.logprobs is not None and ch.logprobs.content]
    return "".join(ch.delta.content for ch in content), sizes, chunks[-1].model_extra["qladder"]


# Its answer's first tokens on the INT4 server (greedy): logprobs -0.66, -1.55, each over the diffuse
# bound -2.2 (none held by the diffuse rule).
SURE = "Who painted the Mona Lisa?"


def test_an_unflagged_sure_draft_streams_at_once_and_a_flagged_inputs_draft_is_held_and_scored(
        model_info, vllm_server, tmp_path):
    """Fast mode: an unflagged input's answer streams as its tokens pass the guard (its first text
    before its 8th token) and costs vLLM nothing; the same prompt with a NUL byte in it (removed by
    the input defence, so the same ids and the same greedy answer, but flagged) holds its first 8
    tokens until vLLM has scored them."""
    def drafts() -> dict[str, int]:
        s = server.engine.stats()
        return {k: s[f"drafts_{k}"] for k in ("passed", "refused", "unchecked", "skipped")}

    with LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024) as ls, \
            serving(ls.base_url, vllm_server.base_url, tmp_path) as (server, base):
        before = drafts()
        sure_text, sure_sizes, sure_ext = _stream_chunks(base, SURE, 24)
        between = drafts()
        flagged_text, flagged_sizes, flagged_ext = _stream_chunks(base, SURE.replace(" ", "\x00 ", 1), 24)
        after = drafts()
    assert flagged_ext["input_changes"] and not sure_ext.get("input_changes")
    assert sure_text == flagged_text and not sure_ext["hazards"] and not flagged_ext["hazards"]
    assert {k: between[k] - before[k] for k in before} == {"passed": 0, "refused": 0, "unchecked": 0, "skipped": 0}
    assert {k: after[k] - between[k] for k in before} == {"passed": 1, "refused": 0, "unchecked": 0, "skipped": 0}
    # what was held before a client saw text: the unflagged answer's none past the diffuse rule's
    # own (its first tokens are sure); the flagged one's whole draft until vLLM had scored it
    assert sure_ext["timings"]["first_text_tokens"] <= 2 and flagged_ext["timings"]["first_text_tokens"] >= 8
    assert sure_sizes[0] <= 2, sure_sizes
    assert sum(sure_sizes) == sum(flagged_sizes) == sum(sure_ext["tokens_per_rung"].values())
