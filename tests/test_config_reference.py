"""The configuration reference is generated from the code and stays true: docs/CONFIG.md is
`qladder config reference`'s output, every field has a doc, the file of defaults parses to the
defaults, any topology written back parses to itself, and every environment variable a module
reads is a Settings field."""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields, replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qladder.cli import app
from qladder.config import Settings, doc_of, env_name
from qladder.server.config_reference import SECTIONS, render_markdown, render_toml
from qladder.server.topology import PoolConfig, Topology, parse_topology, remote_topology

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_the_generated_reference():
    committed = (ROOT / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    assert committed == render_markdown(), ("docs/CONFIG.md and the code differ: "
                                            "run `qladder config reference > docs/CONFIG.md`")


def test_every_field_of_every_section_and_the_environment_has_a_doc():
    for _, cls, _ in SECTIONS:
        for f in fields(cls):
            assert len(doc_of(cls, f.name)) > 10, f"{cls.__name__}.{f.name} has no doc"
    for f in fields(Settings):
        assert f.metadata["env"].startswith("QLADDER_") and len(f.metadata["doc"]) > 10


def test_the_file_of_defaults_parses_to_the_defaults():
    assert parse_topology(tomllib.loads(render_toml(Topology()))) == Topology()
    assert parse_topology(tomllib.loads(render_toml(Topology(), comments=False))) == Topology()


@pytest.mark.parametrize("topology", [
    remote_topology("http://127.0.0.1:8080", ("http://127.0.0.1:8000", "http://127.0.0.1:8001"), redact=True,
                    verify_below=0.9),
    replace(Topology(), pools=(PoolConfig("int4", ("int4",), weight=1.0, handoff_to="standby", audit_rate=0.2,
                                          detect=False, prompt_cache_mb=0),
                               PoolConfig("standby", ("int8", "fp32"), threads=2, sessions=2))),
], ids=["remote-replicas", "in-process-int8"])
def test_a_topology_written_back_parses_to_itself(topology):
    assert parse_topology(tomllib.loads(render_toml(topology))) == topology


def test_config_show_prints_a_files_effective_configuration_and_refuses_a_bad_one(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[server]\nredact = true\n[breaker]\nprobes = 5\n')
    r = CliRunner().invoke(app, ["config", "show", str(good), "--bare"])
    assert r.exit_code == 0, r.output
    shown = parse_topology(tomllib.loads(r.output))
    assert shown.server.redact is True and shown.breaker.probes == 5 and shown.pools == Topology().pools
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nredcat = true\n')
    r = CliRunner().invoke(app, ["config", "show", str(bad)])
    assert r.exit_code == 2 and "unknown key 'redcat'" in r.output
    r = CliRunner().invoke(app, ["config", "reference"])
    assert r.exit_code == 0 and r.output == render_markdown()


def test_every_environment_variable_read_anywhere_is_a_settings_field():
    declared = {f.metadata["env"] for f in fields(Settings)}
    read = set()
    for path in (ROOT / "src" / "qladder").rglob("*.py"):
        read |= set(re.findall(r"\bQLADDER_[A-Z0-9_]+\b", path.read_text(encoding="utf-8")))
    assert read - declared == set(), "read but not declared in qladder.config.Settings"
    assert env_name("n_threads") == "QLADDER_THREADS"


def test_settings_read_the_environment_through_their_fields(tmp_path):
    s = Settings.from_env({"QLADDER_CACHE_DIR": str(tmp_path), "QLADDER_THREADS": "3", "QLADDER_N_CTX": "512",
                           "QLADDER_INT4_MONITOR": "0", "QLADDER_LLAMA_SERVER": "/opt/llama-server"})
    assert (s.cache_dir, s.n_threads, s.n_ctx, s.int4_monitor, s.llama_server) == (
        tmp_path, 3, 512, False, "/opt/llama-server")
    default = Settings.from_env({"XDG_CACHE_HOME": str(tmp_path)})
    assert default.cache_dir == tmp_path / "qladder" and default.int4_monitor is True and default.vllm_python == ""
