"""Fuzzing the HTTP layer: schemathesis generates requests from the server's own OpenAPI schema
(valid and invalid bodies, wrong types, missing fields) and none may get a 5xx. The app is the
real one (real tokenizer, input defence, chat template, gateway, routing) over the fake client,
so thousands of cases run in seconds; the real engine's own checks are in test_server.py."""

from __future__ import annotations

import dataclasses
from collections import Counter

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from qladder.engines.llamacpp import LlamaVocab
from qladder.model import inspect_model
from qladder.server.metrics import ServerMetrics
from qladder.server.serve import assemble
from qladder.server.topology import Topology

from .fakes import FakeClient

_info = inspect_model()
_vocab = LlamaVocab(_info)
_t = Topology()
_t = dataclasses.replace(_t, server=dataclasses.replace(_t.server, allow_faults=True, default_max_tokens=64))
_gw, _app = assemble(FakeClient(), _info, _vocab, _t, ServerMetrics())
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)
MAX_EXAMPLES = 1000  # per operation (8 of them)


def _fuzz(op, counts: Counter[str]) -> None:
    """Up to MAX_EXAMPLES generated cases of one operation; none may get a 5xx."""

    # Valid bodies and invalid ones (wrong types, missing fields, values outside the schema), as
    # schemathesis' own test generator mixes them.
    modes = st.one_of(*(op.as_strategy(mode).map(lambda c, mode=mode: (mode, c)) for mode in GenerationMode))

    @given(drawn=modes)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(drawn) -> None:
        mode, case = drawn
        counts["count"] += 1
        counts[f"mode {mode.value}"] += 1
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body \
                and counts["count"] % 4:
            case.body["model"] = _t.server.model_name  # most cases name the served model, to get past the 404
        response = case.call()
        counts[f"{case.method} {case.path} {response.status_code}"] += 1
        assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
        if response.status_code >= 400 and case.path.startswith("/v1/"):
            assert set(response.json()["error"]) >= {"message", "type", "code"}

    run()


def test_no_generated_request_gets_a_5xx_and_both_outcomes_are_reached():
    """One test, so that its count is its own: every operation of the schema fuzzed with valid and
    invalid bodies, at least 2,000 cases in all (500 of them invalid), and on both OpenAI routes
    accepted and refused requests were made."""
    counts: Counter[str] = Counter()
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions"}
    for op in ops:
        _fuzz(op, counts)
    assert counts["count"] >= 2000 and counts["mode negative"] >= 500, counts
    seen = str(sorted(counts.items()))
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert counts[f"POST {path} 200"] >= 5 and counts[f"POST {path} 400"] > 200, seen
