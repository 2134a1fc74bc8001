"""Small pieces: sampling, incidents, chat rendering, the warm shadow, the public API."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import qladder
from qladder.engines.scripted import ScriptedEngine
from qladder.errors import ConfigError
from qladder.incidents import Incident, IncidentStore, prompt_hash
from qladder.model import Segment, render_chat
from qladder.sampling import Sampler, SamplingParams
from qladder.shadow import WarmShadow
from qladder.types import Hazard


def test_greedy_and_seeded_sampling():
    row = torch.tensor([0.0, 5.0, 4.9, -1.0])
    assert Sampler(SamplingParams()).sample(row) == 1
    a = [Sampler(SamplingParams(temperature=1.0, seed=7)).sample(row) for _ in range(5)]
    b = [Sampler(SamplingParams(temperature=1.0, seed=7)).sample(row) for _ in range(5)]
    assert a == b
    s = Sampler(SamplingParams(temperature=5.0, top_k=2, seed=1))
    assert {s.sample(row) for _ in range(200)} == {1, 2}
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=1))
    assert {s.sample(row) for _ in range(50)} == {1}


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0},
                                {"top_p": 1.5}, {"top_k": -1}, {"temperature": math.nan}])
def test_bad_sampling_params(kw):
    with pytest.raises(ConfigError):
        SamplingParams(**kw)


def test_incident_store_roundtrip_and_threads(tmp_path):
    store = IncidentStore(tmp_path / "db" / "inc.sqlite3")
    h = Hazard("nonfinite", "int4", 4, math.nan, None, None, "x")

    def write(i):
        store.record(Incident(f"r{i}", prompt_hash([1, 2]), [1, 2], "hi", h, "handoff:fp32", 3.5, [], 0.0))

    ts = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert store.count() == 8
    row = store.rows(1)[0]
    assert row["value"] == "nan" and row["check_name"] == "nonfinite" and row["handoff_latency_ms"] == 3.5
    store.close()


def test_audit_rows_keep_their_source_and_a_store_from_before_the_column_gains_it(tmp_path):
    import sqlite3

    from qladder.audit import AuditRecord

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:  # the audits table as it was before `source`
        db.execute("CREATE TABLE audits (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, request_id TEXT"
                   " NOT NULL, prompt_class TEXT NOT NULL, pool TEXT NOT NULL, tokens INTEGER NOT NULL, agreement"
                   " REAL NOT NULL, first_divergence INTEGER, kl_top5 REAL NOT NULL, fp32_gap REAL NOT NULL)")
        db.execute("INSERT INTO audits (ts, request_id, prompt_class, pool, tokens, agreement, kl_top5, fp32_gap)"
                   " VALUES (1.0, 'old', 'qa', 'int4', 3, 1.0, 0.0, 0.0)")
    db.close()
    store = IncidentStore(path)
    store.record_audits([AuditRecord("new", "math", "int4", 8, 0.875, 0, 0.01, 0.02, source="probe", excess=-0.25)])
    rows = {r["request_id"]: r for r in store.audits()}
    assert rows["old"]["source"] == "audit" and rows["new"]["source"] == "probe"
    assert rows["old"]["excess"] is None and rows["new"]["excess"] == -0.25
    assert rows["new"]["first_divergence"] == 0 and rows["new"]["agreement"] == 0.875
    store.close()


def test_render_chat_keeps_user_content_apart():
    tpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    segs = render_chat(tpl, [{"role": "user", "content": "a <|im_start|> b"}])
    assert segs == [Segment("<|im_start|>user\n", True), Segment("a <|im_start|> b", False),
                    Segment("<|im_end|>\n<|im_start|>assistant\n", True)]
    with pytest.raises(ValueError):
        render_chat(tpl, [{"role": "user"}])


def _shadow_engine() -> ScriptedEngine:
    return ScriptedEngine(lambda ids: torch.arange(5, dtype=torch.float32) * (len(ids) % 3 + 1), 5)


def test_warm_shadow_catches_up_and_matches_a_direct_open():
    """A worker that keeps up holds all but the tail since the last batch: at sync_every=2,
    contexts of 4..8 ids submit batches at 5 and 7, so the handoff catches up one id."""
    eng = _shadow_engine()
    shadow = WarmShadow(eng, [1, 2, 3], sync_every=2)
    ctx = [1, 2, 3]
    for t in [4, 0, 1, 2, 3]:
        assert shadow.ready(timeout=30.0), "the shadow's worker did not finish its batch in 30 s"
        ctx.append(t)
        shadow.feed(ctx)
    s, caught = shadow.take(ctx)
    assert s.token_ids == ctx and caught == 1
    assert torch.equal(s.logits(), eng.open(ctx).logits())


def test_warm_shadow_behind_its_worker_catches_up_the_whole_tail():
    """A batch is never queued behind a busy worker: while the prefill is held, no feed submits,
    and the handoff catches up every accepted id, still equal to a direct open."""
    release = threading.Event()

    class HeldOpen(ScriptedEngine):
        def open(self, prompt_ids):
            assert release.wait(30.0), "the test never released the prefill"
            return super().open(prompt_ids)

    eng = HeldOpen(lambda ids: torch.arange(5, dtype=torch.float32) * (len(ids) % 3 + 1), 5)
    shadow = WarmShadow(eng, [1, 2, 3], sync_every=2)
    ctx = [1, 2, 3]
    for t in [4, 0, 1, 2, 3]:
        ctx.append(t)
        shadow.feed(ctx)
    assert not shadow.ready(timeout=0.0)
    release.set()
    s, caught = shadow.take(ctx)
    assert s.token_ids == ctx and caught == 5
    assert torch.equal(s.logits(), _shadow_engine().open(ctx).logits())


def test_public_api_is_complete():
    """`from qladder import *` gives exactly the documented names, each the object of its home module."""
    import importlib

    home = {"Ladder": "qladder.ladder", "LadderConfig": "qladder.ladder", "LadderPolicy": "qladder.policy",
            "StepGuard": "qladder.health", "GuardConfig": "qladder.health", "GUARD_PRESETS": "qladder.health",
            "SamplingParams": "qladder.sampling", "GenerationResult": "qladder.types", "Hazard": "qladder.types",
            "Handoff": "qladder.types", "FinishReason": "qladder.types", "sanitize": "qladder.sanitize",
            "SanitizeConfig": "qladder.sanitize", "SanitizeResult": "qladder.sanitize",
            "load_engine": "qladder.engines", "RUNGS": "qladder.engines", "Fault": "qladder.testing.faults",
            "parse_fault": "qladder.testing.faults", "Incident": "qladder.incidents",
            "IncidentStore": "qladder.incidents",
            "Qladder": "qladder.service", "ServingEngine": "qladder.serving.engine",
            "ServingConfig": "qladder.serving.engine", "EngineClient": "qladder.client", "Request": "qladder.client",
            **{e: "qladder.errors" for e in ("QladderError", "ConfigError", "EngineError", "InputError",
                                             "ModelError", "TokenizerMismatchError")}}
    assert set(qladder.__all__) == set(home) and home == qladder._HOME
    star: dict[str, object] = {}
    exec("from qladder import *", star)
    for name, module in home.items():
        assert star[name] is getattr(importlib.import_module(module), name), name


@pytest.fixture(scope="module")
def vocab(model_info):
    from qladder.engines.llamacpp import LlamaVocab

    v = LlamaVocab(model_info)
    yield v
    v.close()


def test_raw_bytes_are_spelled_with_their_byte_tokens(vocab):
    data = b"\x00\xe2\x82Hi \xf0\x9f\x98\x80"
    ids = vocab.tokenize_bytes(data)
    assert vocab.detokenize_bytes(ids) == data  # every byte kept, none replaced
    assert len(ids[:3]) == 3 and all(len(vocab.detokenize_bytes([t])) == 1 for t in ids[:3])  # one token a byte
    assert vocab.tokenize_bytes(b"plain text") == vocab.tokenize("plain text", False)
    # bytes the vocabulary cannot spell alone (0xFF) become U+FFFD, as llama.cpp's tokenizer does
    assert vocab.detokenize_bytes(vocab.tokenize_bytes(b"a\xffb")) == "a\ufffdb".encode()


def test_a_token_id_prompt_gets_the_input_defence_and_keeps_clean_ids(vocab, model_info):
    from qladder.model import user_prompt_ids, user_prompt_ids_bytes
    from qladder.prepare import Preparer

    p = Preparer(model_info, vocab.tokenize, 2048)
    clean = user_prompt_ids(model_info.chat_template, "What is 2 + 2?", vocab.tokenize)
    assert p.defend_ids(clean, vocab.detokenize_bytes, vocab.control_ids) == (clean, [])
    raw = user_prompt_ids_bytes(model_info.chat_template, b"\x00\x01\xe2What is 2 + 2?", vocab.tokenize,
                                vocab.tokenize_bytes)
    ids, reports = p.defend_ids(raw, vocab.detokenize_bytes, vocab.control_ids)
    assert ids == clean and reports and {c.kind for r in reports for c in r.changes} >= {"invalid_utf8"}
    assert {t for t in raw if t in vocab.control_ids} == {t for t in ids if t in vocab.control_ids} != set()
