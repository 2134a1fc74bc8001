"""`qladder validate --remote` on real servers, sized down: llama-server on the embedded GGUF and
on two patched copies (an inf scale, a x1000 scale), each with a `qladder serve` process in front,
and the session's vLLM as the standby. Bare is clients straight to llama-server."""

from __future__ import annotations

import json

import pytest

from qladder.errors import ConfigError
from qladder.validate.remote import EXAMPLE_CONFIG, RemoteValidateConfig, load_remote_config, validate_remote

pytestmark = pytest.mark.slow


def test_the_bundled_example_config_is_the_full_runs_defaults_and_mistakes_are_listed(tmp_path):
    assert load_remote_config(None, quick=False) == RemoteValidateConfig()
    assert load_remote_config(EXAMPLE_CONFIG, quick=False) == RemoteValidateConfig()
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nclients = "four"\nfault_names = ["nan_logits"]\n[gpu]\nx = 1\n')
    with pytest.raises(ConfigError) as e:
        load_remote_config(bad, quick=True)
    for part in ("unknown section [gpu]", "clients: expected int", "not faults of a served model"):
        assert part in str(e.value)


def test_validate_remote_shows_the_faults_bare_and_none_through_the_gateway(vllm_server, tmp_path):
    cfg = RemoteValidateConfig(quick=True, max_tokens=16, normal_per_class=1, rounds=1, warmup=1, clients=2,
                               abnormal_per_class={"long_math": 1, "code_block": 1, "long_repeat": 1},
                               prompts_per_fault=2, fault_names=("inf_scale", "corrupted_scale"),
                               n_ctx_per_slot=1024, vllm_url=vllm_server.base_url)
    r = validate_remote(cfg, tmp_path, show_progress=False)
    b, g = r["bare"], r["guarded"]
    assert b["by_fault"]["inf_scale"]["garbage_rate"] == 1.0  # "......" with 200 OK
    assert b["by_fault"]["corrupted_scale"]["garbage_rate"] > 0
    for fault in ("inf_scale", "corrupted_scale"):
        assert g["by_fault"][fault]["garbage_rate"] == 0 and g["by_fault"][fault]["error_rate"] == 0
    assert g["error_rate"] == 0 and b["error_rate"] == 0
    assert g["handoff"]["count"] >= 4 and "vllm" in g["rung_share_all"]
    assert r["p99_ratio_gateway_over_bare"] is not None and r["latency_ratio_guarded_over_bare"]["pairs"] == 4
    assert r["incidents_recorded"]["inf_scale"] == 2 and r["incidents_recorded"]["corrupted_scale"] >= 2
    servers = r["environment"]["servers"]
    assert servers["vllm"]["version"] == "0.32.0" and servers["llama_server"]["threads"] == 1
    assert "-np" in servers["llama_server"]["args"] and servers["concurrency"]["clients"] == 2
    assert all(v and v > 0 for v in r["environment"]["memory_rss_mb"].values())
    assert json.loads((tmp_path / "results.json").read_text())["kind"] == "remote"
    assert "P99 of normal requests, gateway / bare" in (tmp_path / "report.md").read_text()
