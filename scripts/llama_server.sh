#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from the llama.cpp tree vendored in the llama-cpp-python
# sdist of the same version as the wheel, in the wheel's own CMake build tree
# (scripts/llama_wheel.sh): ggml and llama are compiled once, for both; only the server's own
# targets (common, mtmd, the server) are added. Kept in a cache keyed by that version.
# Usage: scripts/llama_server.sh PYTHON VERSION  -> prints the path of the llama-server binary.
# Offline apart from the package registry (the sdist); ~2 minutes on 2 cores the first time.
set -euo pipefail
py=${1:?python}
ver=${2:?version}
here=$(cd "$(dirname "$0")" && pwd)
wheels=$("$here/llama_wheel.sh" "$py" "$ver")
cache=${QLADDER_SERVER_CACHE:-$HOME/.cache/qladder/llama-server}/llama-cpp-python-$ver
bin=$cache/bin/llama-server
if [ ! -x "$bin" ]; then
  build=$wheels/build
  if [ ! -f "$build/CMakeCache.txt" ]; then
    echo "no build tree in $wheels (an older cache): rebuilding the wheel's cache" >&2
    rm -rf "$wheels"
    wheels=$("$here/llama_wheel.sh" "$py" "$ver")
  fi
  echo "building llama-server in llama-cpp-python $ver's build tree ($build, ~2 min on 2 cores) into $cache" >&2
  # No web UI, no curl, no TLS: nothing is fetched at run time. The wheel's options stay in the
  # build tree's cache, so ggml and llama are not compiled again ($ORIGIN: relinked, not recompiled).
  cmake -S "$wheels/src" -B "$build" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_BUILD_RPATH=$ORIGIN' >&2
  cmake --build "$build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" >&2
  # The server and the shared libraries it links, side by side ($ORIGIN finds them).
  rm -rf "$cache/bin.tmp" && mkdir -p "$cache/bin.tmp"
  cp -P "$build/bin/llama-server" "$build"/bin/lib*.so* "$cache/bin.tmp/"
  rm -rf "$cache/bin" && mv "$cache/bin.tmp" "$cache/bin"
fi
echo "$bin"
