#!/usr/bin/env bash
# llama.cpp's own server (llama-server), built once from the llama.cpp sources vendored in the
# llama-cpp-python sdist that .venv pins, for the serving side-by-side (bench/side_by_side.py), and
# llama-perplexity beside it (the KV cache's agreement, `treadle bench kv --quality`).
#
#   scripts/build_llama_server.sh          # prints the binary's path; builds it the first time (~7 min on 2 cores)
#   scripts/build_llama_server.sh --where  # prints where it is or would be, builds nothing
#
# Release, and built for the instruction sets this CPU lists rather than GGML_NATIVE
# (scripts/llama_cpp_cmake_args.sh says why; the Makefile passes the same options as CMAKE_ARGS). Each
# set of options builds into a directory of its own, so a build made on another CPU is never reused.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CMAKE_ARGS="${CMAKE_ARGS:-$("$(dirname "$0")"/llama_cpp_cmake_args.sh)}"
CACHE="${TREADLE_CACHE:-$HOME/.cache/treadle}/llama-server-$VERSION"
BUILD="$CACHE/build-$(echo "$CMAKE_ARGS" | sha1sum | cut -c1-10)"
BINARY="$BUILD/bin/llama-server"
PYTHON="${PYTHON:-.venv/bin/python}"

if { [ -x "$BINARY" ] && [ -x "$BUILD/bin/llama-perplexity" ]; } || [ "${1:-}" = "--where" ]; then
    echo "$BINARY"
    exit 0
fi
mkdir -p "$CACHE"
if [ ! -d "$CACHE/src" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$CACHE" "llama-cpp-python==$VERSION" >&2
    mkdir -p "$CACHE/src"
    tar -xzf "$CACHE"/llama_cpp_python-"$VERSION".tar.gz -C "$CACHE/src" --strip-components=1
    rm -f "$CACHE"/llama_cpp_python-"$VERSION".tar.gz
fi
# shellcheck disable=SC2086 # CMAKE_ARGS is a list of options
cmake -S "$CACHE/src/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    $CMAKE_ARGS >&2
cmake --build "$BUILD" --target llama-server llama-perplexity -j "$(nproc)" >&2
echo "$BINARY"
