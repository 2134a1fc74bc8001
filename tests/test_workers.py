"""`qladder serve --workers N` for real: two gateway processes on one port in front of a real
llama-server, sharing state through a real Redis; and the refusal for in-process rungs."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from qladder.peers.llama_server import LlamaServer
from qladder.peers.process import start_qladder_serve, stop
from qladder.peers.stores import RedisServer
from qladder.server.serve import WORKER_ENV

pytestmark = pytest.mark.slow


def test_two_workers_on_one_port_answer_concurrent_clients_and_stop_cleanly(model_info, tmp_path):
    import openai

    redis = RedisServer().start()
    llama = LlamaServer(model_info.path, n_parallel=4, threads=1, n_ctx_per_slot=1024).start()
    config = tmp_path / "fleet.toml"
    config.write_text(f"""
[server]
incidents = "{tmp_path / 'incidents.sqlite3'}"
[[pools]]
name = "edge"
rungs = ["llama-server"]
urls = ["{llama.base_url}"]
slots = 4
weight = 1.0
[state]
backend = "redis"
url = "{redis.url}"
""")
    key = "sk-fleet-test-key"
    proc, base = start_qladder_serve(config, tmp_path / "serve.log", args=["--workers", "2", "--api-key", key])
    try:
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2, [c.cmdline() for c in psutil.Process(proc.pid).children()]
        for p in (psutil.Process(proc.pid), *workers):  # the key reaches the workers by a 0600 file, not the env
            assert not any(key in v for v in p.environ().values()) and key not in " ".join(p.cmdline()[:-2])
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        answers: list = [None] * 6

        def ask(k: int) -> None:
            answers[k] = client.chat.completions.create(
                model="smollm2-135m-instruct", max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": f"Name a color. ({k})"}])

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(a is not None and a.choices[0].message.content for a in answers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert all(not w.is_running() or w.status() == psutil.STATUS_ZOMBIE for w in workers)
    finally:
        stop(proc)
        llama.stop()
        redis.close()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "with 2 workers" in log and "Traceback" not in log


def _one_pool(tmp_path, url: str, slots: int):
    """A topology of one pool on the llama-server at `url`, and nothing else."""
    config = tmp_path / "fleet.toml"
    config.write_text(f"""
[[pools]]
name = "edge"
rungs = ["llama-server"]
urls = ["{url}"]
slots = {slots}
weight = 1.0
""")
    return config


def test_workers_refuse_in_process_rungs():
    from qladder.cli import app

    r = CliRunner().invoke(app, ["serve", "--workers", "2"])
    assert r.exit_code != 0 and "needs every pool on servers" in r.stderr
    r = CliRunner().invoke(app, ["serve", "--workers", "0"])
    assert r.exit_code != 0 and "--workers must be >= 1" in r.stderr


def test_a_worker_that_cannot_start_stops_the_command_with_its_reason(tmp_path):
    """Every worker fails to build its server (the llama-server it names is not there): the
    command exits non-zero with the reason, at once (uvicorn's STARTUP_FAILURE), not a restart loop."""
    import subprocess
    import sys
    import time

    from qladder.peers.process import free_port

    config = _one_pool(tmp_path, f"http://127.0.0.1:{free_port()}", slots=4)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "qladder", "serve", "--config", str(config), "--port", str(free_port()),
                        "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "a gateway worker could not start" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("Child process") <= 2, r.stderr[-2000:]  # each worker tried once, none restarted
    print(f"stopped {time.monotonic() - t0:.1f} s after the start")


def _wait_for(cond, what: str, timeout_s: float) -> None:
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.2)


def test_a_worker_restarted_while_its_peer_is_down_tries_again_and_the_gateway_keeps_serving(model_info, tmp_path):
    """A worker dies while the llama-server is down: uvicorn restarts it, and it cannot build its
    server. It must not end the gateway (STARTUP_FAILURE would stop every worker): it tries again,
    backing off, and serves once the peer is back; the command never stopped."""
    import httpx

    llama = LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024).start()
    config = _one_pool(tmp_path, llama.base_url, slots=2)
    log = tmp_path / "serve.log"
    proc, base = start_qladder_serve(config, log, args=["--workers", "2"])

    def text() -> str:
        return log.read_text(errors="replace")

    try:
        _wait_for(lambda: text().count("Application startup complete") >= 2, "both workers to start", 120)
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2
        port = llama.port
        llama.stop()
        survivor = workers[1]
        workers[0].kill()  # dies while its peer is down: uvicorn restarts it, and it cannot build
        _wait_for(lambda: "this restarted gateway worker could not start" in text(), "the restarted worker's retry", 60)
        assert proc.poll() is None, text()[-3000:]  # the gateway still runs
        llama = LlamaServer(model_info.path, n_parallel=2, threads=1, n_ctx_per_slot=1024, port=port).start()
        _wait_for(lambda: text().count("Application startup complete") >= 3, "the restarted worker to start", 120)
        for k in range(4):  # both workers answer (the kernel spreads the connections)
            with httpx.Client(timeout=120) as client:
                r = client.post(f"{base}/v1/chat/completions", json={
                    "model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Name a color. ({k})"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        # The peer down again and the other worker killed: the gateway is stopped while the
        # restarted worker retries. Every worker ends at once (uvicorn's handler would only set a
        # flag the retry never reads: the supervisor would join it forever) and the topology file
        # with the API keys is removed.
        llama.stop()
        retries = text().count("this restarted gateway worker could not start")
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        folder = Path(workers[0].environ()[WORKER_ENV])
        assert (folder / "topology.pickle").exists()
        assert survivor in workers
        survivor.kill()  # the other worker, killed in turn while its peer is down
        _wait_for(lambda: text().count("this restarted gateway worker could not start") > retries,
                  "the second restarted worker's retry", 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, text()[-3000:]
        assert not folder.exists()
    finally:
        stop(proc)
        llama.stop()
    assert "a gateway worker could not start" not in text()
