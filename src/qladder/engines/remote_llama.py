"""A remote rung on llama.cpp's `llama-server`: `/completion` with a token-array prompt.

    rung = LlamaServerRung(info, "http://127.0.0.1:8080")   checks the server's tokenizer at start
    async for item in rung.stream(client, ids, params, n)    RemoteToken* RemoteEnd

llama-server adds no BOS to a token array; `return_tokens` streams the ids, `n_probs` the top-k
with log-probabilities. On a NaN row it streams `logprob: null` and top-k ids 0, 1, 2 (the
`......` answer): the guard sees that before the token is released.

Measured on this build (llama.cpp vendored by llama-cpp-python 0.3.36): while a character's UTF-8
bytes span several tokens (an emoji ZWJ sequence), the server holds the text back and then
streams one chunk with the id of the last token only: the ids before it are lost from the stream
(the non-streaming answer has them all), and the per-token `bytes` of `completion_probabilities`
drift out of line from there on. So each single-token chunk's `content` is the token's bytes as
the server sent them, checked against the vocabulary (`mismatch`): a chunk whose text is not its
token's is never released, and the answer continues on the next rung from the last ids known.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from qladder.engines.remote import HttpRung, RemoteEnd, check_stream_status
from qladder.errors import RemoteStreamError, RemoteTransportError
from qladder.health.remote import RemoteToken
from qladder.model import ModelInfo
from qladder.sampling import SamplingParams


class LlamaServerRung(HttpRung):
    name = "llama-server"
    precision = "llama.cpp's llama-server (remote): the GGUF's kernels, as served"
    server = "llama-server"

    def __init__(self, info: ModelInfo, base_url: str, n_probs: int = 4, timeout_s: float = 10.0):
        super().__init__(info, base_url, n_probs, timeout_s)

    def _connect(self, timeout_s: float) -> None:
        props = httpx.get(f"{self.base_url}/props", timeout=timeout_s).json()
        self.n_ctx = int(props["default_generation_settings"]["n_ctx"])
        self.n_slots = int(props.get("total_slots", 1))
        self.server_model = str(props.get("model_path", ""))
        self.build = str(props.get("build_info", ""))
        self._check_tokenizer(timeout_s, lambda t: {"content": t, "parse_special": True},
                              lambda ids: {"tokens": ids}, "tokens", "content")

    def body(self, ids: list[int], params: SamplingParams, n_remaining: int) -> dict[str, object]:
        """The /completion request that continues `ids`: the server samples with the request's own
        settings (its extra samplers off), and streams each token with its top-k logprobs.

        A greedy answer is sent with top_k 1: the same argmax, and llama-server's sampler chain
        then runs on one candidate instead of the whole vocabulary (its reported logprobs are taken
        before sampling, from every logit, either way). Measured on one 1-thread replica, 8
        clients: 1.032x the tokens/s of top_k 0 (bench/llama_server_nprobs.py; its result is
        bench/results/llama-server-nprobs-2026-12-05)."""
        return {"prompt": ids, "n_predict": n_remaining, "stream": True, "return_tokens": True,
                "n_probs": max(self.n_probs, params.logprobs or 0), "temperature": params.temperature,
                "top_p": params.top_p, "top_k": 1 if params.greedy else params.top_k, "min_p": 0.0,
                "seed": params.seed % (2**32), "repeat_penalty": 1.0, "cache_prompt": True,
                "ignore_eos": params.ignore_eos}

    async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                     n_remaining: int) -> AsyncGenerator[RemoteToken | RemoteEnd, None]:
        body = self.body(ids, params, n_remaining)
        async with client.stream("POST", f"{self.base_url}/completion", json=body) as r:
            await check_stream_status(r, "llama-server")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                try:
                    chunk = json.loads(line[6:])
                    toks = [int(t) for t in chunk.get("tokens") or []]
                except (ValueError, TypeError, AttributeError) as exc:
                    raise RemoteStreamError(f"a malformed chunk from llama-server: {exc}") from exc
                if "error" in chunk:
                    raise RemoteStreamError(f"llama-server: {str(chunk['error'])[:200]}")
                probs = chunk.get("completion_probabilities") or []
                # The chunk's text, against which its one token's bytes are checked: llama-server holds
                # back an incomplete UTF-8 character and then streams only the id of the token that
                # completed it, dropping the ids before it (their bytes arrive in `content`).
                text = str(chunk.get("content") or "").encode("utf-8", "surrogatepass") if len(toks) == 1 else None
                for i, t in enumerate(toks):
                    yield _token(t, probs[i] if i < len(probs) else {}, text)
                if chunk.get("stop"):
                    yield RemoteEnd(length=chunk.get("stop_type") == "limit")
                    return
        raise RemoteTransportError("llama-server's stream ended before its last chunk")


def _token(t: int, p: dict[str, Any], text: bytes | None) -> RemoteToken:
    top = tuple((int(x.get("id", -1)), x.get("logprob")) for x in p.get("top_logprobs") or [])
    return RemoteToken(t, p.get("logprob"), text, top)
