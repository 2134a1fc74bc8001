"""A remote rung on vLLM's OpenAI server: `/v1/completions` with token ids as the prompt.

    rung = VllmRung(info, "http://127.0.0.1:8000")          checks the server's tokenizer at start
    async for item in rung.stream(client, ids, params, n)    RemoteToken* RemoteEnd

`return_token_ids` streams the sampled ids, `logprobs` the top-k (capped by the server's
`--max-logprobs`), and `return_tokens_as_token_ids` keys the top-k by id ("token_id:N") rather
than by text. vLLM samples token 0 from an all-NaN row and answers 200 (the `!!!!` of vLLM
issues #14126, #15194); its OpenAI layer clamps a -inf logprob to -9999.0, which the guard
reads as non-finite. Here vLLM serves the full-precision standby (the fp32 safetensors folder
qladder caches for its torch rungs), so its answers are judged like any other rung's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any, NamedTuple

import httpx

from qladder.audit import TopRow
from qladder.engines.remote import HttpRung, RemoteEnd, check_stream_status
from qladder.errors import RemoteStreamError, RemoteTransportError
from qladder.health.remote import RemoteToken, Scored
from qladder.model import ModelInfo
from qladder.sampling import SamplingParams


class VllmRung(HttpRung):
    can_score = True
    name = "vllm"
    precision = "vLLM's OpenAI server (remote), as served (the standby: fp32 weights)"
    server = "vLLM"

    def __init__(self, info: ModelInfo, base_url: str, n_slots: int = 8, n_probs: int = 4,
                 timeout_s: float = 10.0):
        self.n_slots = n_slots
        super().__init__(info, base_url, n_probs, timeout_s)

    def _connect(self, timeout_s: float) -> None:
        models = httpx.get(f"{self.base_url}/v1/models", timeout=timeout_s).json()["data"]
        self.model = str(models[0]["id"])
        self.n_ctx = int(models[0]["max_model_len"])
        self.version = str(httpx.get(f"{self.base_url}/version", timeout=timeout_s).json()["version"])
        self._check_tokenizer(timeout_s, lambda t: {"model": self.model, "prompt": t, "add_special_tokens": False},
                              lambda ids: {"model": self.model, "tokens": ids}, "tokens", "prompt")
        # vLLM 0.32's CPU build sets up its logprobs path lazily: the first request asking for
        # them takes ~2.8 s here, then ~0.1 s. Pay it now, not on a handoff.
        self._post(max(timeout_s, 60.0), "/v1/completions", {"model": self.model, "prompt": [min(self.eos_ids)],
                   "max_tokens": 1, "logprobs": self.n_probs, "temperature": 0})

    def body(self, ids: list[int], params: SamplingParams, n_remaining: int) -> dict[str, object]:
        """The /v1/completions request that continues `ids`, sampled with the request's settings
        (vLLM's penalties off); stop strings and EOS stay qladder's (`skip_special_tokens` off)."""
        return {"model": self.model, "prompt": ids, "max_tokens": n_remaining, "stream": True,
                "logprobs": max(self.n_probs, params.logprobs or 0), "return_token_ids": True,
                "return_tokens_as_token_ids": True, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k or -1, "seed": params.seed % (2**32), "ignore_eos": params.ignore_eos,
                "skip_special_tokens": False, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0}

    async def stream(self, client: httpx.AsyncClient, ids: list[int], params: SamplingParams,
                     n_remaining: int) -> AsyncGenerator[RemoteToken | RemoteEnd, None]:
        body = self.body(ids, params, n_remaining)
        async with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as r:
            await check_stream_status(r, "vLLM")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line[6:].strip() == "[DONE]":
                    break
                try:
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RemoteStreamError(f"vLLM: {str(chunk['error'])[:200]}")
                    choice = chunk["choices"][0]
                    toks = [int(t) for t in choice.get("token_ids") or []]
                    lp = choice.get("logprobs") or {}
                    chosen = lp.get("token_logprobs") or []
                    tops = lp.get("top_logprobs") or []
                    items = [RemoteToken(t, chosen[i] if i < len(chosen) else None, None,
                                         _top(tops[i] if i < len(tops) else None)) for i, t in enumerate(toks)]
                except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
                    raise RemoteStreamError(f"a malformed chunk from vLLM: {exc!r}") from exc
                for item in items:
                    yield item
                if choice.get("finish_reason"):
                    yield RemoteEnd(length=choice["finish_reason"] == "length")
                    return
        raise RemoteTransportError("vLLM's stream ended before a finish_reason")

    async def score(self, client: httpx.AsyncClient, prompt: list[int], draft: list[int]) -> list[Scored]:
        answer = await _completion(client, self.base_url, score_body(self.model, prompt, draft))
        try:
            return draft_scores(answer, len(prompt), draft)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise RemoteStreamError(f"vLLM's prompt_logprobs are malformed: {exc!r}") from exc

    async def score_top(self, client: httpx.AsyncClient, prompt: list[int], answer: list[int],
                        k: int = 20) -> list[TopRow]:
        """The audit's call: each answer token's logprob and rank after `prompt`, and fp32's top
        `k` there (capped by the server's `--max-logprobs`), in one prefill."""
        body = score_body(self.model, prompt, answer)
        body["prompt_logprobs"] = k
        reply = await _completion(client, self.base_url, body)
        try:
            return top_rows(reply, len(prompt), answer)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise RemoteStreamError(f"vLLM's prompt_logprobs are malformed: {exc!r}") from exc

    async def verify(self, client: httpx.AsyncClient, context: list[int], draft: list[int]) -> Verdict:
        """Verified decoding's one call: `draft` after `context` scored, and vLLM's own greedy
        token after it, in one prefill."""
        answer = await _completion(client, self.base_url, score_body(self.model, context, draft, self.n_probs))
        try:
            return Verdict(draft_scores(answer, len(context), draft), next_token(answer))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise RemoteStreamError(f"vLLM's verdict is malformed: {exc!r}") from exc


async def _completion(client: httpx.AsyncClient, base_url: str, body: dict[str, object]) -> dict[str, Any]:
    r = await client.post(f"{base_url}/v1/completions", json=body)
    if r.status_code != 200:  # a 5xx is the server's failure (a pool of replicas tries a sibling)
        error = RemoteTransportError if r.status_code >= 500 else RemoteStreamError
        raise error(f"vLLM answered HTTP {r.status_code}: {r.text[:200]}")
    return dict(r.json())


def score_body(model: str, prompt: list[int], draft: list[int], n_probs: int = 0) -> dict[str, object]:
    """The /v1/completions request that scores `draft` after `prompt` in one prefill
    (`prompt_logprobs`: each token's and the argmax's) and generates one greedy token after it
    (with `n_probs` top logprobs; `verify` reads it, `score` does not)."""
    return {"model": model, "prompt": prompt + draft, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1,
            "logprobs": n_probs, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}


def draft_scores(answer: dict[str, Any], n_prompt: int, draft: Sequence[int]) -> list[Scored]:
    """Each draft token's logprob, rank (1: the model's argmax there) and the argmax itself from
    the answer to `score_body` (KeyError, IndexError, TypeError or ValueError when it is not that
    answer)."""
    rows = answer["choices"][0]["prompt_logprobs"][n_prompt:]
    out = []
    for row, t in zip(rows, draft, strict=True):
        best = next((int(k) for k, v in row.items() if int(v["rank"]) == 1), None)
        out.append(Scored(float(row[str(t)]["logprob"]), int(row[str(t)]["rank"]), best))
    return out


def top_rows(answer: dict[str, Any], n_prompt: int, answer_ids: Sequence[int]) -> list[TopRow]:
    """Each answer token's logprob and rank and its position's entries by rank (the top k, and
    the token's own where it is outside them) from the answer to `score_body` with
    `prompt_logprobs` = k (errors as `draft_scores`)."""
    rows = answer["choices"][0]["prompt_logprobs"][n_prompt:]
    out = []
    for row, t in zip(rows, answer_ids, strict=True):
        ranked = sorted((int(v["rank"]), int(key), float(v["logprob"])) for key, v in row.items())
        out.append(TopRow(float(row[str(t)]["logprob"]), int(row[str(t)]["rank"]),
                          tuple((i, lp) for _, i, lp in ranked)))
    return out


def next_token(answer: dict[str, Any]) -> RemoteToken:
    """The greedy token the answer to `score_body` generated after the draft."""
    choice = answer["choices"][0]
    lp = choice.get("logprobs") or {}
    chosen, tops = lp.get("token_logprobs") or [None], lp.get("top_logprobs") or [None]
    return RemoteToken(int(choice["token_ids"][0]), chosen[0], None, _top(tops[0]))


class Verdict(NamedTuple):
    """vLLM's verdict on a draft: each token scored, and its own greedy token after the draft."""

    scored: list[Scored]
    next: RemoteToken


def _top(d: dict[str, float | None] | None) -> tuple[tuple[int, float | None], ...]:
    if not d:
        return ()
    return tuple((int(k.rsplit(":", 1)[1]) if k.startswith("token_id:") else -1, v) for k, v in d.items())
