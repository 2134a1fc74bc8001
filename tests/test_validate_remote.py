"""`qladder validate --remote` on real servers, sized down: llama-server on the embedded GGUF (twice:
the A/A pair) and on patched copies (an inf scale of the train set, a held-out x30 scale of the test
set), each with a `qladder serve` process in front, and the session's vLLM as the standby. Bare is
clients straight to llama-server."""

from __future__ import annotations

import json

import pytest

from qladder.errors import ConfigError
from qladder.validate.remote import (
    EXAMPLE_CONFIG,
    RemoteValidateConfig,
    gateway_toml,
    load_remote_config,
    validate_remote,
)

pytestmark = pytest.mark.slow


def test_the_bundled_example_config_is_the_full_runs_defaults_and_mistakes_are_listed(tmp_path):
    assert load_remote_config(None, quick=False) == RemoteValidateConfig()
    assert load_remote_config(EXAMPLE_CONFIG, quick=False) == RemoteValidateConfig()
    assert {m.fault_set for m in RemoteValidateConfig().models()} == {"train", "test"}
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nclients = "four"\nfault_names = ["nan_logits"]\n[gpu]\nx = 1\n'
                   '[gateway]\nprecision = "some"\n')
    with pytest.raises(ConfigError) as e:
        load_remote_config(bad, quick=True)
    for part in ("unknown section [gpu]", "clients: expected int", "not faults of a served model",
                 "precision: 'some' is none of fast, verified"):
        assert part in str(e.value)
    verified = tmp_path / "verified.toml"
    verified.write_text('[gateway]\nprecision = "verified"\n')
    c = load_remote_config(verified, quick=True)
    assert c.gateway_precision == "verified"
    toml = gateway_toml("http://a", "http://b", c, tmp_path / "i.db")
    from qladder.server.topology import load_topology

    (tmp_path / "serve.toml").write_text(toml)
    t = load_topology(tmp_path / "serve.toml")
    assert t.int4.precision == "verified" and t.standby is not None and t.standby.rungs == ("vllm",)


def test_validate_remote_shows_the_faults_bare_and_none_through_the_gateway(vllm_server, tmp_path, capsys):
    from qladder.validate import recompute
    from qladder.validate.outcome import read_jsonl

    cfg = RemoteValidateConfig(quick=True, max_tokens=16, normal_per_class=1, rounds=1, warmup=1, clients=2,
                               abnormal_per_class={"long_math": 2, "code_block": 2, "control_bytes": 2},
                               prompts_per_fault=2, fault_names=("inf_scale", "scale_x30_rows"), reference_prompts=2,
                               n_ctx_per_slot=1024, vllm_url=vllm_server.base_url)
    r = validate_remote(cfg, tmp_path, show_progress=False)
    code = recompute.main([str(tmp_path)])  # a miniature run: its verdicts may not pass, its figures reproduce
    assert "reproduced exactly" in capsys.readouterr().out and code == recompute.exit_code(r["figures"]["verdict"])
    f = r["figures"]
    assert f["by_fault"]["bare"]["inf_scale"]["garbage_rate"] == 1.0  # "......" with 200 OK
    for fault in ("inf_scale", "scale_x30_rows"):  # nothing lost, either way
        g = f["by_fault"]["guarded"][fault]
        assert g["five_xx"] == 0 and g["fallback"] == 0, (fault, g)
    # the NaN path is refused at its first token; scale_x30_rows's finite salad passes fast mode's step
    # guard (no full precision on the path): finding that endpoint is the audit's detection, not this run's
    assert f["by_fault"]["guarded"]["inf_scale"]["garbage_net"] == 0
    assert {v["fault_set"] for v in f["by_fault"]["guarded"].values() if v["fault_set"]} == {"train", "test"}
    outs = read_jsonl(tmp_path / "outcomes.jsonl")
    assert {o.config for o in outs} == {"bare", "bare_aa", "guarded"}
    answered = [o for o in outs if o.ok and o.token_ids]
    assert answered and all(o.token_ids_source == "server" for o in answered)
    inf = [o for o in outs if o.config == "bare" and o.fault == "inf_scale"]
    assert all(set(o.token_ids) == {30} and len(o.token_ids) == 16 for o in inf)  # the server's own ids
    raw = [o for o in outs if o.prompt_class == "control_bytes" and o.phase == "abnormal"]
    assert {o.config for o in raw} == {"bare", "guarded"}
    assert all("\\x" in o.prompt for o in raw if o.config == "bare")  # as sent: the raw bytes, escaped
    assert all("\x00" not in o.prompt and "\\x" not in o.prompt for o in raw if o.config == "guarded")
    assert f["handoff"]["guarded"]["count"] >= 2 and "vllm" in f["rung_share"]["guarded"]  # inf_scale's two
    q = f["quality"]["all"]  # the faulted answers that left INT4 (inf_scale's two at least) against fp32's
    assert q["requests"] >= 2 and q["requests"] + q["faulted_never_moved"] == 4 and q["not_computed"] == 0
    assert r["incidents_recorded"]["inf_scale"] == 2
    servers = r["environment"]["servers"]
    assert servers["vllm"]["version"] == "0.32.0" and servers["llama_server"]["threads"] == 1
    assert set(servers["llama_server"]["models"]) == {"clean", "clean_aa", "inf_scale", "scale_x30_rows"}
    assert all(v and v > 0 for v in r["environment"]["memory_rss_mb"].values())
    assert json.loads((tmp_path / "results.json").read_text())["kind"] == "remote"
    assert "Verdict" in (tmp_path / "report.md").read_text()
