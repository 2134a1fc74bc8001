#!/usr/bin/env bash
# Build llama-cpp-python's wheel once, portable, and keep it in a cache keyed by version.
# Usage: scripts/llama_wheel.sh PYTHON VERSION  -> prints the cache folder holding the wheel.
# A source build takes ~4 minutes on 2 cores; a cached wheel installs in seconds.
#
# The cache folder keeps what scripts/llama_server.sh needs to compile llama.cpp only once:
#   src/    the sdist, unpacked (the wheel is built from this folder, in place)
#   build/  the wheel's CMake build tree (ggml and llama compiled; llama-server is added to it)
#   *.whl   the wheel
set -euo pipefail
py=${1:?python}
ver=${2:?version}
cache=${QLADDER_WHEEL_CACHE:-$HOME/.cache/qladder/wheels}/llama-cpp-python-$ver
if ! ls "$cache"/llama_cpp_python-"$ver"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $ver wheel (portable, ~4 min on 2 cores) into $cache" >&2
  rm -rf "$cache"
  mkdir -p "$cache"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==$ver" >&2
  tar -xzf "$tmp"/llama_cpp_python-"$ver".tar.gz -C "$cache"
  mv "$cache/llama_cpp_python-$ver" "$cache/src"
  # llama-cpp-python forces llama.cpp's common library on (a FORCEd cache entry), though its Python
  # code never loads it: ~2.5 of the ~6.5 minutes on 2 cores. Un-FORCEd, -DLLAMA_BUILD_COMMON=OFF
  # below holds; scripts/llama_server.sh turns it on in this build tree for the server, which uses it.
  lists=$cache/src/CMakeLists.txt
  forced='set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
  if grep -qF "$forced" "$lists"; then
    sed -i "s/$forced/${forced% FORCE)})/" "$lists"
  else
    echo "llama-cpp-python $ver no longer forces LLAMA_BUILD_COMMON as expected: building it too" >&2
  fi
  # GGML_NATIVE=OFF: a -march=native wheel breaks on other CPUs sharing this cache.
  # The system's cmake and ninja (not copies in pip's throw-away build environment), so that
  # scripts/llama_server.sh can reconfigure this build tree later.
  CMAKE_GENERATOR=Ninja \
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_MAKE_PROGRAM=$(command -v ninja)" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$py" -m pip wheel --no-cache-dir --no-deps -w "$tmp/wheel" \
      --config-settings=build-dir="$cache/build" "$cache/src" >&2
  mv "$tmp"/wheel/llama_cpp_python-*.whl "$cache"/
fi
echo "$cache"
