"""The engine contract for the remote rungs, on real servers: llama.cpp's llama-server on the
embedded GGUF and vLLM's CPU build on its fp32 folder, both started by the tests. A remote rung
streams sampled tokens, not rows, so each clause of tests/test_engines_contract.py reads here as
what the remote pool relies on: the same vocabulary as the local rungs (fingerprint, n_vocab,
EOS, detokenize_bytes), every streamed token in the vocabulary with finite logprobs and a top-k,
an end that says whether the budget ran out, greedy answers that repeat, and continuation by
token ids (the remote rollback: the context with the first k tokens continues as the whole answer
did). `score` is what a rung that can check a draft declares."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import httpx
import pytest

from qladder.engines.remote import RemoteEnd
from qladder.engines.remote_llama import LlamaServerRung
from qladder.engines.remote_vllm import VllmRung
from qladder.engines.replicas import Replicas
from qladder.health.remote import RemoteToken, Scored
from qladder.model import user_prompt_ids
from qladder.peers.llama_server import LlamaServer
from qladder.sampling import SamplingParams

from .conftest import get_engine

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llama_server(model_info) -> Iterator[LlamaServer]:
    with LlamaServer(model_info.path, n_parallel=1, threads=1, n_ctx_per_slot=1024) as s:
        yield s


@pytest.fixture(params=["llama-server", "replicas", pytest.param("vllm", marks=pytest.mark.xdist_group("vllm"))])
def rung(request, model_info) -> Iterator[LlamaServerRung | VllmRung | Replicas]:
    r: LlamaServerRung | VllmRung | Replicas
    if request.param == "llama-server":
        r = LlamaServerRung(model_info, request.getfixturevalue("llama_server").base_url)
    elif request.param == "replicas":  # a pool of replicas (two endpoints on the one server here)
        url = request.getfixturevalue("llama_server").base_url
        r = Replicas([LlamaServerRung(model_info, url), LlamaServerRung(model_info, url)])
    else:
        r = VllmRung(model_info, request.getfixturevalue("vllm_server").base_url)
    yield r
    r.close()


def _stream(rung, ids: list[int], n: int, params: SamplingParams = GREEDY) -> tuple[list[RemoteToken], RemoteEnd]:
    async def run() -> tuple[list[RemoteToken], RemoteEnd]:
        toks: list[RemoteToken] = []
        async with httpx.AsyncClient(timeout=120) as client:
            async for item in rung.stream(client, ids, params, n):
                if isinstance(item, RemoteEnd):
                    return toks, item
                if isinstance(item, RemoteToken):  # (a pool of replicas also names its endpoint: RemoteAt)
                    toks.append(item)
        raise AssertionError("the stream ended without a RemoteEnd")

    return asyncio.run(run())


def _prompt(model_info, rung, text: str = "Name three colors.") -> list[int]:
    return user_prompt_ids(model_info.chat_template, text, rung.tokenize)


def test_the_vocabulary_is_the_local_rungs(rung):
    int4 = get_engine("int4")
    assert rung.n_ctx > 0 and rung.n_slots >= 1
    assert (rung.n_vocab, rung.eos_ids, rung.fingerprint) == (int4.n_vocab, int4.eos_ids, int4.fingerprint)
    ids = rung.tokenize("Hola 😊🌍 · naïve — 東京 <|im_end|>", True)
    assert rung.detokenize_bytes(ids) == int4.detokenize_bytes(ids)


def test_every_streamed_token_is_in_the_vocabulary_with_finite_logprobs_and_the_budget_ends_it(rung, model_info):
    toks, end = _stream(rung, _prompt(model_info, rung), 12)
    assert len(toks) == 12 and end.length  # ignore_eos: only the budget ends it
    for t in toks:
        assert 0 <= t.token_id < rung.n_vocab
        assert t.logprob is not None and math.isfinite(t.logprob) and t.logprob <= 1e-6
        assert len(t.top) >= 3 and all(v is not None and math.isfinite(v) for _, v in t.top)
        # Greedy: the drawn token is the top-1 of the tokens it may draw. Under ignore_eos (a
        # benchmark setting) llama-server bans EOS and reports the distribution before the ban (EOS
        # may be its top-1 there); vLLM, like the in-process rungs, may draw EOS and go on.
        banned = rung.eos_ids if rung.name == "llama-server" else frozenset()
        allowed = [(i, v) for i, v in t.top if i not in banned]
        best_id, best = max(allowed, key=lambda x: x[1])
        assert t.token_id == best_id or t.logprob == pytest.approx(best, abs=1e-5)  # (or tied with it)


def test_greedy_answers_repeat_and_continue_by_token_ids(rung, model_info):
    p = _prompt(model_info, rung)
    first = [t.token_id for t in _stream(rung, p, 16)[0]]
    assert [t.token_id for t in _stream(rung, p, 16)[0]] == first
    k = 6
    rest, end = _stream(rung, p + first[:k], 16 - k)  # what a handoff to this rung sends
    assert [t.token_id for t in rest] == first[k:] and end.length


def test_an_answer_that_stops_before_its_budget_ends_without_the_length_flag(rung, model_info):
    """EOS (not ignored) ends the answer: the end says so (no length flag), and no token after the
    first EOS is streamed."""
    params = SamplingParams(max_tokens=256, temperature=0.0, logprobs=3)
    toks, end = _stream(rung, _prompt(model_info, rung, "Say only the word yes."), 256, params)
    ids = [t.token_id for t in toks]
    assert ids and not end.length and len(ids) < 256
    assert not any(t in rung.eos_ids for t in ids[:-1])


def test_a_rung_that_can_score_gives_the_draft_its_own_likelihood(rung, model_info):
    p = _prompt(model_info, rung)

    async def score(draft: list[int]) -> list[Scored]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await rung.score(client, p, draft)

    if not rung.can_score:
        with pytest.raises(NotImplementedError):
            asyncio.run(score([1]))
        return
    toks = _stream(rung, p, 8)[0]
    own = asyncio.run(score([t.token_id for t in toks]))
    assert len(own) == 8
    for t, s in zip(toks, own, strict=True):  # one prefill scores what the stream drew, the same
        assert t.logprob is not None and s.logprob == pytest.approx(t.logprob, abs=0.05)
        assert s.rank == 1  # greedy: each drawn token is its own argmax there (the drift check's flag)
    odd = asyncio.run(score([rung.tokenize(" zebra", False)[0]] * 8))
    assert sum(s.logprob for s in odd) < sum(s.logprob for s in own) - 10  # a draft it would not write
    assert odd[0].rank > 1  # is far less likely, and not its argmax


def test_a_greedy_answer_asks_llama_server_for_top_k_1_and_a_sampled_one_for_its_own():
    """The same argmax with the sampler chain on one candidate (the n_probs come from every logit
    before sampling either way); a sampled answer keeps the request's top_k."""
    from types import SimpleNamespace

    from qladder.sampling import SamplingParams

    rung = SimpleNamespace(n_probs=4)
    greedy = LlamaServerRung.body(rung, [1, 2], SamplingParams(max_tokens=8), 8)  # type: ignore[arg-type]
    sampled = LlamaServerRung.body(rung, [1, 2], SamplingParams(temperature=0.7, top_k=20, max_tokens=8),  # type: ignore[arg-type]
                                   8)
    assert (greedy["top_k"], greedy["n_probs"], greedy["temperature"]) == (1, 4, 0.0)
    assert (sampled["top_k"], sampled["temperature"]) == (20, 0.7)
