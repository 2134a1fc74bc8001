"""The command line as a user meets it: answers, JSON, and one-line errors for bad input.

Answers run the real command in a child process (argv bytes, stdin, exit status). Bad input is
refused before any model loads, so those tests invoke the same typer app in this process (the
last test shows that the console script and `python -m qladder` are that app): a child would
spend its seconds importing torch to print one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

QLADDER = [sys.executable, "-m", "qladder"]


def run(*args: str | bytes, stdin: bytes | None = None, env: dict[str, str] | None = None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([*QLADDER, *args], input=stdin, capture_output=True, env=e, timeout=300)


def _one_line_error(*args: str) -> str:
    """The command's one error line: a non-zero exit, one `qladder: error:` line on stderr, and no
    exception escaped the app (a crash, not a refusal)."""
    from typer.testing import CliRunner

    from qladder.cli import app

    r = CliRunner().invoke(app, list(args))
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("qladder: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_generate_json_with_a_nan_fault_hands_off(tmp_path):
    db = tmp_path / "inc.sqlite3"
    p = run("generate", "--ladder", "int4,fp32", "--fault", "nan@step=2", "--max-tokens", "12", "--json",
            "--incidents", str(db), "Name a primary color.")
    assert p.returncode == 0, p.stderr.decode()
    out = json.loads(p.stdout)
    for key in ("text", "token_ids", "token_rungs", "hazards", "handoffs", "finish_reason", "rung", "timings"):
        assert key in out
    assert out["token_rungs"][:2] == ["int4", "int4"] and out["token_rungs"][2] == "fp32"
    h = out["hazards"][0]
    assert (h["check"], h["rung"], h["step"], h["value"]) == ("nonfinite", "int4", 2, "nan")
    assert {"layer", "threshold"} <= set(h)
    import sqlite3

    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*), MAX(prompt_text) FROM incidents").fetchone() == (1, "Name a primary color.")


def test_generate_plain_text():
    p = run("generate", "--rung", "int4", "--max-tokens", "24",
            "What is the capital of France? Answer in one sentence.")
    assert p.returncode == 0 and "Paris" in p.stdout.decode()


def test_generate_verified_gives_fp32s_answer_and_refuses_a_ladder_with_no_verifier():
    p = run("generate", "--verified", "--json", "--max-tokens", "24", "What is the capital of France?")
    assert p.returncode == 0, p.stderr.decode()
    out = json.loads(p.stdout)
    from qladder.model import inspect_model, user_prompt_ids
    from qladder.validate.replay import greedy

    from .conftest import get_engine

    fp32 = get_engine("fp32")  # fp32's own greedy answer, in this process (the same weights)
    ref = greedy(fp32, user_prompt_ids(inspect_model().chat_template, "What is the capital of France?",
                                       fp32.tokenize), 24)
    assert out["token_ids"] == ref and "Paris" in out["text"]
    assert set(out["token_rungs"]) == {"fp32"} and out["timings"].get("verify_windows", 0) >= 1, out
    assert "needs a ladder that starts on int4" in _one_line_error("generate", "--verified", "--rung", "fp32", "Hi")


def test_stdin_with_invalid_utf8_and_nul_bytes_is_handled():
    p = run("generate", "--rung", "int4", "--max-tokens", "8", "--json", "-",
            stdin=b"Say hello.\x00\xff\xfe \xed\xa0\x80")
    assert p.returncode == 0, p.stderr.decode()
    kinds = {c["kind"] for c in json.loads(p.stdout)["input_changes"]}
    assert "invalid_utf8" in kinds and "control_removed" in kinds


def test_lone_surrogate_argument_is_sanitized():
    # Python decodes undecodable argv bytes to lone surrogates (surrogateescape).
    p = subprocess.run([*QLADDER, "generate", "--rung", "int4", "--max-tokens", "4", "--json",
                        os.fsencode("hi \udcff there")], capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    assert "surrogate_removed" in {c["kind"] for c in json.loads(p.stdout)["input_changes"]}


def test_unknown_rung():
    assert "unknown rung 'int3'" in _one_line_error("generate", "--rung", "int3", "hi")


def test_bad_fault_spec():
    assert "unknown fault" in _one_line_error("generate", "--fault", "boom@step=1", "hi")
    assert "malformed fault" in _one_line_error("generate", "--fault", "nan@step=x", "hi")


def test_missing_model_file(tmp_path):
    assert "not found" in _one_line_error("generate", "--model", str(tmp_path / "nope.gguf"), "hi")


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    assert "GGUF" in _one_line_error("generate", "--model", str(bad), "hi")


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "unsupported architecture 'gpt2'" in _one_line_error("generate", "--model", str(path), "hi")


def test_prompt_longer_than_context_is_truncated_and_reported():
    words = " ".join(f"word{i}" for i in range(6000))  # ~ 18k tokens, a context of 512
    p = run("generate", "--rung", "int4", "--max-tokens", "4", "--json", words, env={"QLADDER_N_CTX": "512"})
    assert p.returncode == 0, p.stderr.decode()
    out = json.loads(p.stdout)
    assert "truncated_tokens" in {c["kind"] for c in out["input_changes"]}
    assert 256 < out["prompt_tokens"] <= 512 - 4


def test_bad_sampling_value():
    assert "top_p" in _one_line_error("generate", "--top-p", "0", "hi")


@pytest.mark.parametrize("n", [0])
def test_max_tokens_must_be_positive(n):
    assert "max_tokens" in _one_line_error("generate", "--max-tokens", str(n), "hi")


def test_help_lists_commands():
    p = run("--help")
    assert p.returncode == 0 and b"generate" in p.stdout and b"bench" in p.stdout


def test_console_script_and_module_entry_point_are_the_same_command():
    """`qladder` (the installed script) and `python -m qladder` (every test here) run one app."""
    script = Path(sys.executable).with_name("qladder")
    assert script.is_file(), f"no console script beside {sys.executable}: is the package installed?"
    a = subprocess.run([str(script), "--help"], capture_output=True, timeout=300)
    b = run("--help")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and b"validate" in a.stdout
