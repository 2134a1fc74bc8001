#!/usr/bin/env bash
# Build llama-cpp-python's wheel once, portable, and keep it in a cache keyed by version.
# Usage: scripts/llama_wheel.sh PYTHON VERSION  -> prints the cache folder holding the wheel.
# A source build takes ~6 minutes on 2 cores; a cached wheel installs in seconds.
set -euo pipefail
py=${1:?python}
ver=${2:?version}
cache=${QLADDER_WHEEL_CACHE:-$HOME/.cache/qladder/wheels}/llama-cpp-python-$ver
if ! ls "$cache"/llama_cpp_python-"$ver"-*.whl >/dev/null 2>&1; then
  mkdir -p "$cache"
  tmp=$(mktemp -d)
  echo "building llama-cpp-python $ver wheel (portable, ~6 min on 2 cores) into $cache" >&2
  # GGML_NATIVE=OFF: a -march=native wheel breaks on other CPUs sharing this cache.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$py" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python -w "$tmp" "llama-cpp-python==$ver" >&2
  mv "$tmp"/llama_cpp_python-*.whl "$cache"/
  rm -rf "$tmp"
fi
echo "$cache"
