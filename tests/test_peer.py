"""The peer, built for real: llama.cpp's llama-server from the vendored sources (make install
builds and links it) serves the same greedy answer, from the same prompt tokens, as qladder's
INT4 rung: the load benchmark compares like with like."""

from __future__ import annotations

import httpx
import pytest

from qladder.peers.llama_server import LlamaServer

pytestmark = pytest.mark.slow


def test_llama_server_answers_like_qladders_int4_rung(model_info):
    from qladder.serving import ServingConfig, ServingEngine

    prompt = "Name three colors."
    with LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024) as ls:
        assert "version" in ls.version()
        r = httpx.post(f"{ls.base_url}/v1/chat/completions", timeout=60, json={
            "model": "peer", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0})
    peer = r.json()
    se = ServingEngine(ServingConfig(slots=1, n_ctx=1024, standby_rungs=()), model=model_info)
    try:
        from qladder.model import user_prompt_ids

        ids = user_prompt_ids(model_info.chat_template, prompt, se.int4.tokenize)
        ours = se.generate_sync(se.request(ids))
    finally:
        se.close()
    assert peer["usage"]["prompt_tokens"] == len(ids)
    assert peer["choices"][0]["message"]["content"] == ours.text and ours.text
