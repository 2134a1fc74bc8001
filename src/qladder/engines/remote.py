"""Remote rungs: a serving engine over HTTP (llama.cpp's llama-server, vLLM) as a rung of the ladder.

A remote rung samples each token itself; qladder keeps the vocabulary in-process (the GGUF's
tokenizer, `vocab_only`), sends every context as token ids, and judges each streamed token
(`health/remote.py`) before it is released. So a handoff between any two rungs, remote or
in-process, continues from the same ids:

    async for item in rung.stream(client, context_ids, params, n_remaining):
        RemoteToken(id, logprob, bytes?, top-k) ...  then one RemoteEnd
    (a non-200 answer, an error chunk, a malformed chunk or a stream cut short: RemoteStreamError;
     an unreachable server: httpx.HTTPError)
    item = await next_item(items, limit)    the next item while limit() allows (StreamSilentError past it)

At start-up each rung tokenizes a set of probe texts on its server and detokenizes the ids back;
any difference from the local vocabulary refuses the rung (TokenizerMismatchError): a handoff by
ids between mismatched tokenizers would change the text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from qladder.engines.llamacpp import LlamaVocab
from qladder.errors import (
    EngineError,
    RemoteStreamError,
    RemoteTransportError,
    StreamSilentError,
    TokenizerMismatchError,
)
from qladder.health.remote import RemoteToken, Scored
from qladder.model import ModelInfo
from qladder.sampling import SamplingParams

# Special tokens, emoji, accents, CJK, code indentation, runs of whitespace, zero-width characters.
PROBES = ("Hello, world!", "<|im_start|>user\nhé 🙂 — 1+1=2<|im_end|>\n", "def f(x):\n    return x ** 2",
          " \t\n spaces  and\ttabs", "日本語のテキスト", "\u200b\u00ad zero width")


@dataclass(frozen=True)
class RemoteEnd:
    """The server ended the answer: `length` when its token budget ran out, else EOS or a stop."""

    length: bool


@dataclass(frozen=True)
class RemoteResumed:
    """A pool of replicas moved the stream to a sibling (its endpoint failed): the next token
    comes after the sibling's prefill of the context, a first token's wait, not a step's."""


@dataclass(frozen=True)
class RemoteAt:
    """A pool of replicas says which endpoint (its URL) writes the tokens that follow: before each
    attempt's first token (the audit scores each replica's answers as its own)."""

    endpoint: str


RemoteItem = RemoteToken | RemoteEnd | RemoteResumed | RemoteAt


class RemoteRung(Protocol):
    name: str
    base_url: str
    n_ctx: int
    n_slots: int
    n_vocab: int
    eos_ids: frozenset[int]
    can_score: bool  # `score` works: the rung can check the draft of the rung below (vLLM)

    @property
    def fingerprint(self) -> str: ...  # the local vocabulary's: the start-up probes vouch for the server's

    @property
    def lone_byte_ids(self) -> frozenset[int]: ...  # the vocabulary's byte-fallback tokens

    def detokenize_bytes(self, token_ids: Sequence[int]) -> bytes: ...

    def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
               n_remaining: int) -> AsyncGenerator[RemoteItem, None]:
        """Continue `ids` for at most `n_remaining` tokens, sampled with `params` by the server."""
        ...

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        """This model's logprob and rank of each draft token after `prompt` and the draft tokens
        before it (one prefill)."""
        ...

    async def alive(self, client: httpx.AsyncClient) -> bool:
        """Whether the server answers its health check now (the pool probes an unhealthy rung)."""
        ...

    def close(self) -> None: ...


class HttpRung(LlamaVocab):
    """What the remote rungs share: the local vocabulary (the GGUF's, `vocab_only`), then
    `_connect` asks the server for its facts and runs the tokenizer probes. Any failure there
    closes the vocabulary and raises EngineError naming the server; a mismatch stays a
    TokenizerMismatchError."""

    server = "a server"  # how messages name it
    can_score = False

    def __init__(self, info: ModelInfo, base_url: str, n_probs: int, timeout_s: float):
        super().__init__(info)
        self.base_url = base_url.rstrip("/")
        self.n_probs = n_probs
        try:
            self._connect(timeout_s)
        except (httpx.HTTPError, KeyError, ValueError, IndexError, TypeError) as exc:
            self.close()
            raise EngineError(f"{self.server} at {self.base_url} cannot be used: {exc!r}") from exc
        except TokenizerMismatchError:
            self.close()
            raise

    def _connect(self, timeout_s: float) -> None:
        raise NotImplementedError

    async def alive(self, client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(f"{self.base_url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        raise NotImplementedError(f"{self.server} cannot score a draft")

    def _post(self, timeout_s: float, path: str, body: dict[str, object]) -> dict[str, Any]:
        return post_json(self.base_url, path, body, timeout_s)

    def _check_tokenizer(self, timeout_s: float, tokenize: Callable[[str], dict[str, object]],
                         detokenize: Callable[[list[int]], dict[str, object]], tokens_key: str,
                         text_key: str) -> None:
        """The probes, with the server's own /tokenize and /detokenize request bodies."""
        check_tokenizer(f"{self.server} at {self.base_url}",
                        lambda t: self._post(timeout_s, "/tokenize", tokenize(t))[tokens_key],
                        lambda ids: self._post(timeout_s, "/detokenize", detokenize(ids))[text_key],
                        self.tokenize, self.detokenize_bytes)


def check_tokenizer(where: str, remote_tokenize: Callable[[str], list[int]],
                    remote_detokenize: Callable[[list[int]], str],
                    local_tokenize: Callable[[str, bool], list[int]],
                    local_detokenize: Callable[[list[int]], bytes]) -> None:
    """Every probe text must tokenize to the same ids on the server as locally, and the server must
    turn those ids (control tokens left out) back into the same text; else TokenizerMismatchError."""
    for text in PROBES:
        theirs, ours = remote_tokenize(text), local_tokenize(text, True)
        if theirs != ours:
            raise TokenizerMismatchError(
                f"{where} tokenizes {text!r} as {theirs[:12]}, this model as {ours[:12]}: a handoff by "
                "token ids would change the text; refusing the rung")
        text_ids = [t for t in ours if local_detokenize([t])]  # control tokens render as text remotely only
        back, local = remote_detokenize(text_ids), local_detokenize(text_ids).decode("utf-8", "replace")
        if back != local:
            raise TokenizerMismatchError(
                f"{where} detokenizes {text_ids[:12]} as {back!r}, this model as {local!r}; refusing the rung")


def post_json(base_url: str, path: str, body: dict[str, object], timeout_s: float) -> dict[str, Any]:
    """A blocking JSON POST to a server (start-up probes); httpx.HTTPError on a failure."""
    r = httpx.post(f"{base_url}{path}", json=body, timeout=timeout_s)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


async def check_stream_status(r: httpx.Response, server: str) -> None:
    """RemoteStreamError unless the server answered the stream with 200 (the body says why not)."""
    if r.status_code != 200:
        text = (await r.aread()).decode("utf-8", "replace")[:200]
        error = RemoteTransportError if r.status_code >= 500 else RemoteStreamError
        raise error(f"{server} answered HTTP {r.status_code}: {text}")


async def next_item(items: AsyncIterator[RemoteItem], limit: Callable[[], float]) -> RemoteItem:
    """The stream's next item, waited for while `limit()` seconds from now allow (recomputed as
    the wait goes on: a prefill that starts beside it extends it); StreamSilentError past it."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    nxt: asyncio.Future[RemoteItem] = asyncio.ensure_future(anext(items))
    try:
        while True:
            allowed = limit()
            left = t0 + allowed + 0.05 - loop.time() if allowed < 1e9 else None
            if left is not None and left <= 0:
                raise StreamSilentError(allowed)
            done, _ = await asyncio.wait({nxt}, timeout=left)
            if done:
                return nxt.result()
    finally:
        if not nxt.done():  # the server is silent past its limit (or the request ended): stop waiting
            nxt.cancel()
            await asyncio.wait({nxt})
