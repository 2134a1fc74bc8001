"""`qladder serve` for real: uvicorn on 127.0.0.1, the real engines, the official `openai` client
(sync and async): chat and completions, streaming and not, token-id prompts, logprobs, injected
faults handed off mid-stream, disconnects that abort, the breaker and the incident store."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from qladder.server.breaker import BreakerConfig
from qladder.server.serve import build_server
from qladder.server.topology import Topology

from .conftest import get_engine, live_app
from .fakes import Clock

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
CLOCK = Clock()  # the breakers' and quarantine's: moved by the tests that need time to pass
PROMPTS = ["Name three colors.", "What is 2+2?", "Write a haiku about rain.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    db = tmp_path_factory.mktemp("incidents") / "incidents.sqlite3"
    t = Topology()
    t = dataclasses.replace(
        t, server=dataclasses.replace(t.server, allow_faults=True, incidents=str(db)),
        breaker=BreakerConfig(window_s=60, min_requests=4, max_hazard_rate=0.5, open_s=1.5, probes=2))
    server = build_server(t, clock=CLOCK, standby_engines=[get_engine("fp32")])
    try:
        with live_app(server.app) as v1:
            yield v1.removesuffix("/v1"), server
    finally:
        server.close()


@pytest.fixture
def client(live):
    base, _ = live
    with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _chat(text):
    return [{"role": "user", "content": text}]


def test_chat_matches_qladder_generate_for_a_greedy_prompt(client):
    r = client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[0]), max_tokens=24, temperature=0)
    cli = _cli_generate(PROMPTS[0], "24")
    assert r.choices[0].message.content == cli["text"] and r.choices[0].message.content
    assert r.choices[0].finish_reason == cli["finish_reason"]
    assert r.usage.completion_tokens == len(cli["token_ids"]) and r.usage.prompt_tokens == cli["prompt_tokens"]
    ext = r.model_extra["qladder"]
    assert ext["tokens_per_rung"] == {"int4": len(cli["token_ids"])} and ext["hazards"] == []


def test_a_faulted_stream_is_one_clean_answer_continued_on_fp32(client, live):
    _, server = live
    before = server.store.count()
    kw = {"model": MODEL, "messages": _chat(PROMPTS[2]), "max_tokens": 32, "temperature": 0,
          "extra_body": {"qladder": {"faults": ["nan@step=4"]}}}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ext = chunks[-1].model_extra["qladder"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == sum(ext["tokens_per_rung"].values())
    assert [h["check"] for h in ext["hazards"]] == ["nonfinite"]
    assert ext["handoffs"][0]["from_rung"] == "int4" and ext["handoffs"][0]["to_rung"] == "fp32"
    assert ext["tokens_per_rung"]["int4"] == 4 and ext["tokens_per_rung"]["fp32"] > 0
    assert "\ufffd" not in text and "nan" not in text.lower() and text.strip()
    cli = _cli_generate(PROMPTS[2], "32", "--fault", "nan@step=4")  # the same ladder in one process
    assert text == cli["text"] and cli["token_rungs"].count("int4") == 4  # no gap and no repeat at the seam
    _wait(lambda: server.store.count() == before + 1)  # its incident row, committed by the writer thread
    again = client.chat.completions.create(**kw)  # quarantined: starts on fp32, pays no handoff
    assert again.model_extra["qladder"]["route"] == "quarantine" and again.model_extra["qladder"]["handoffs"] == []


def test_verified_precision_streams_fp32s_answer_and_fast_stays_int4s(client, live):
    """"What is the capital of France?": with "qladder": {"precision": "verified"}, the streamed
    answer is the fp32 rung's own greedy answer (...Paris.), every token decided by fp32; without
    it, INT4's (which is not fp32's here)."""
    fp32 = _cli_generate(PROMPTS[3], "32", "--rung", "fp32")
    assert "Paris" in fp32["text"]
    kw = {"model": MODEL, "messages": _chat(PROMPTS[3]), "max_tokens": 32, "temperature": 0}
    chunks = list(client.chat.completions.create(stream=True, extra_body={"qladder": {"precision": "verified"}},
                                                 **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == fp32["text"]
    assert set(chunks[-1].model_extra["qladder"]["tokens_per_rung"]) == {"fp32"}
    fast = client.chat.completions.create(**kw)
    assert fast.choices[0].message.content != fp32["text"]
    assert set(fast.model_extra["qladder"]["tokens_per_rung"]) == {"int4"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(extra_body={"qladder": {"precision": "exact"}}, **kw)
    scrape = httpx.get(f"{live[0]}/metrics", timeout=30).text
    counts = {w: float(line.split()[-1]) for line in scrape.splitlines() for w in ("windows", "drafts", "kept")
              if line.startswith(f'qladder_verified_total{{what="{w}"}}')}
    assert counts["windows"] >= 1 and 0 < counts["kept"] <= counts["drafts"]


def test_the_input_defence_reports_its_changes_and_incidents_keep_the_sanitized_prompt(client, live):
    _, server = live
    raw = "Name a  color.\x07\u200b Now!"
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_chat(raw), max_tokens=6, temperature=0,
        extra_body={"qladder": {"faults": ["inf@step=2"]}})
    ext = r.parse().model_extra["qladder"]
    kinds = {c["kind"] for c in ext["input_changes"]}
    assert kinds and int(r.headers["x-qladder-input-changes"]) == len(ext["input_changes"])
    _wait(lambda: server.writer.pending == 0 and any(
        row["request_id"] == ext["request_id"] for row in server.store.rows(20)))
    row = next(row for row in server.store.rows(20) if row["request_id"] == ext["request_id"])
    assert "\x07" not in row["prompt_text"] and "\u200b" not in row["prompt_text"] and "color" in row["prompt_text"]


def test_completions_from_text_and_from_token_ids_agree(client, live):
    _, server = live
    ids = server.gateway.preparer.encode_text("The capital of France is", 8)[0]
    a = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=2)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    lp = b.choices[0].logprobs
    assert len(lp.tokens) == b.usage.completion_tokens and "".join(lp.tokens) == b.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == a.choices[0].text


def test_chat_logprobs_top_alternatives_include_the_greedy_token(client):
    r = client.chat.completions.create(model=MODEL, messages=_chat(PROMPTS[1]), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-5 and bytes(c.bytes).decode("utf-8", "replace")


def test_async_clients_stream_concurrently_and_match_their_sequential_answers(live, client):
    base, _ = live
    alone = [client.chat.completions.create(model=MODEL, messages=_chat(p), max_tokens=16, temperature=0)
             .choices[0].message.content for p in PROMPTS]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as c:
            async def one(p):
                s = await c.chat.completions.create(model=MODEL, messages=_chat(p), max_tokens=16, temperature=0,
                                                    stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
            return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(run()) == alone


def test_sampling_with_a_seed_is_reproducible(client):
    kw = {"model": MODEL, "messages": _chat(PROMPTS[2]), "max_tokens": 16, "temperature": 0.9, "seed": 7}
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_errors_reach_the_openai_client_as_its_own_exceptions(client):
    long_ids = get_engine("int4").tokenize(" ".join(f"Item {i} is number {i * 7 % 1000}." for i in range(400)), False)
    assert len(long_ids) > 2048
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=_chat("hi"))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_chat("hi"), n=2)
    assert e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=long_ids, max_tokens=8)  # clean ids: the defence keeps them
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_client_that_disconnects_aborts_its_request(live):
    base, server = live
    body = {"model": MODEL, "messages": _chat("Write a long story about a dragon who learns to bake bread."),
            "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    _wait(lambda: server.engine.stats()["live"] == 0)  # aborted within a step, not after 1500 tokens
    body["stream"] = False
    with httpx.Client(timeout=60) as h, pytest.raises(httpx.ReadTimeout):
        h.post(f"{base}/v1/chat/completions", json=body, timeout=1.0)
    _wait(lambda: server.engine.stats()["live"] == 0)
    metrics = httpx.get(f"{base}/metrics").text
    assert 'qladder_finishes_total{reason="abort"} 2.0' in metrics


def test_breaker_opens_under_a_fault_burst_and_closes_after_recovery(live, client):
    base, server = live
    gw = server.gateway
    CLOCK.t += 61  # past the breaker's 60 s window: the earlier tests' hazards no longer count
    burst = []
    for k in range(60):  # every request of the burst hits a NaN on INT4 (and is handed off)
        burst.append(f"Tell me about the number {k}.")
        client.chat.completions.create(model=MODEL, messages=_chat(burst[-1]), max_tokens=6, temperature=0,
                                       extra_body={"qladder": {"faults": ["nan@step=1"]}})
        if str(gw.breakers["int4"].mode) == "open":
            break
    assert str(gw.breakers["int4"].mode) == "open" and len(burst) >= 4  # min_requests, then the hazard rate
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=_chat("Say hi."), max_tokens=4,
                                                         temperature=0)
    assert r.headers["x-qladder-route"] == "breaker:int4" and r.headers["x-qladder-tokens-per-rung"].startswith("fp32")
    again = client.chat.completions.create(model=MODEL, messages=_chat(burst[0]), max_tokens=6, temperature=0)
    assert again.model_extra["qladder"]["pool"] == "standby"  # quarantined or breaker: never back on INT4 yet
    CLOCK.t += 1.6  # open_s: then probes go to INT4 again
    for p in PROMPTS[:2]:
        client.chat.completions.create(model=MODEL, messages=_chat(p), max_tokens=4, temperature=0)
    _wait(lambda: str(gw.breakers["int4"].mode) == "closed")
    metrics = httpx.get(f"{base}/metrics").text
    for to in ("open", "half_open", "closed"):
        assert f'qladder_breaker_transitions_total{{pool="int4",to="{to}"}}' in metrics
    ready = httpx.get(f"{base}/readyz").json()
    assert ready["ready"] and ready["breakers"]["int4"] == "closed"


def test_incident_rows_equal_the_hazards_counted_by_metrics(client, live):
    """Every hazard the server counted (this test's two, and any other test's on this server) is
    one committed row."""
    base, server = live
    for text in ("Name a fruit.", "Name a tree."):
        client.chat.completions.create(model=MODEL, messages=_chat(text), max_tokens=6, temperature=0,
                                       extra_body={"qladder": {"faults": ["nan@step=1"]}})
    _wait(lambda: server.writer.pending == 0)
    metrics = httpx.get(f"{base}/metrics").text
    hazards = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("qladder_hazards_total{"))
    committed = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("qladder_incidents_committed_total"))
    rows = [(r["check_name"], r["action"]) for r in server.store.rows()]  # (an audit ejection's row is not a hazard)
    assert hazards >= 2 and server.store.count() == hazards == committed, rows


def _cli_generate(prompt, max_tokens, *extra):
    from qladder.cli import app

    out = CliRunner().invoke(app, ["generate", prompt, "--max-tokens", max_tokens, "--ladder", "int4,fp32", "--json",
                                   *extra])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wait(cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _closed_breaker(client, server) -> None:
    """Past the breaker's window with the INT4 breaker closed, so that this test's own faulted
    requests start on INT4 whichever tests ran on this worker's server before (xdist spreads this
    module's tests over the workers, each with its own server): the clock moves past the window
    and open_s, and clean probes close a half-open breaker."""
    gw = server.gateway
    CLOCK.t += 61
    for p in PROMPTS[:2]:
        if str(gw.breakers["int4"].mode) == "closed":
            break
        client.chat.completions.create(model=MODEL, messages=_chat(p), max_tokens=4, temperature=0)
    _wait(lambda: str(gw.breakers["int4"].mode) == "closed")


def test_incidents_cli_lists_shows_and_replays_the_stored_hazards(client, live):
    """Two faulted requests of its own (no other test's hazards needed), then the CLI on the store."""
    from qladder.cli import app

    _, server = live
    _closed_breaker(client, server)  # two hazards of two requests: under min_requests, it stays closed
    ids = []
    for text in ("Name two rivers.", "What is 6 * 7?"):
        r = client.chat.completions.create(model=MODEL, messages=_chat(text), max_tokens=6, temperature=0,
                                           extra_body={"qladder": {"faults": ["nan@step=2"]}})
        ids.append(r.model_extra["qladder"]["request_id"])
    _wait(lambda: server.writer.pending == 0 and {r["request_id"] for r in server.store.rows(20)} >= set(ids))
    db = server.store.path
    runner = CliRunner()
    listed = runner.invoke(app, ["incidents", "list", "--db", db, "--json", "--since", "1h"])
    assert listed.exit_code == 0, listed.output
    rows = [r for r in json.loads(listed.stdout) if r["request_id"] in ids]
    assert len(rows) == 2 and all(r["check_name"] == "nonfinite" and r["action"] == "handoff:fp32" for r in rows)
    shown = runner.invoke(app, ["incidents", "show", str(rows[0]["id"]), "--db", db])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["prompt_hash"] == rows[0]["prompt_hash"]
    assert runner.invoke(app, ["incidents", "show", "999999", "--db", db]).exit_code == 2
    plain = runner.invoke(app, ["incidents", "replay", "--db", db, "--rungs", "int4", "--limit", "2", "--json"])
    faulted = runner.invoke(app, ["incidents", "replay", "--db", db, "--rungs", "int4", "--limit", "2",
                                  "--with-faults", "--json"])
    assert plain.exit_code == 0 and faulted.exit_code == 0, plain.output + faulted.output
    # the hazards came from injected faults: the INT4 rung alone is clean, and they come back with them
    assert [r["rungs"]["int4"]["verdict"] for r in json.loads(plain.stdout)["replays"]] == ["clean", "clean"]
    assert [r["rungs"]["int4"]["verdict"] for r in json.loads(faulted.stdout)["replays"]] == ["reproduced"] * 2
