"""Shared fixtures. Real engines are loaded once per session (the torch ones take ~1 s each from
the on-disk cache; the very first run dequantizes the GGUF, ~15 s)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
