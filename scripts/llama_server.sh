#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` once, from the llama.cpp tree vendored in the llama-cpp-python
# sdist of the same version as the wheel, and keep it in a cache keyed by that version.
# Usage: scripts/llama_server.sh PYTHON VERSION  -> prints the path of the llama-server binary.
# Offline apart from the package registry (the sdist); ~5 minutes on 2 cores the first time.
set -euo pipefail
py=${1:?python}
ver=${2:?version}
cache=${QLADDER_SERVER_CACHE:-$HOME/.cache/qladder/llama-server}/llama-cpp-python-$ver
bin=$cache/bin/llama-server
if [ ! -x "$bin" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "building llama-server from llama-cpp-python $ver's vendored llama.cpp (~5 min on 2 cores) into $cache" >&2
  "$py" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$ver" >&2
  tar -xzf "$tmp"/llama_cpp_python-"$ver".tar.gz -C "$tmp"
  src=$tmp/llama_cpp_python-$ver/vendor/llama.cpp
  # GGML_NATIVE=OFF: portable, like the wheel. No web UI, no curl, no TLS: nothing is fetched at run time.
  cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  cmake --build "$tmp/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" >&2
  mkdir -p "$cache/bin.tmp"
  cp "$tmp/build/bin/llama-server" "$cache/bin.tmp/"
  rm -rf "$cache/bin" && mv "$cache/bin.tmp" "$cache/bin"
fi
echo "$bin"
