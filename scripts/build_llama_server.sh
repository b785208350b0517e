#!/usr/bin/env bash
# llama.cpp's own server (llama-server), built once from the llama.cpp sources vendored in the
# llama-cpp-python sdist that .venv pins, for the serving side-by-side (bench/side_by_side.py).
#
#   scripts/build_llama_server.sh          # prints the binary's path; builds it the first time (~7 min on 2 cores)
#
# Release, and built for the instruction sets named here rather than what the build machine reports:
# on Intel guests that list AMX without granting its state, a native build segfaults on its first
# multi-token batch. Every AVX/AVX2/AVX-512/VNNI/BF16 option on, AMX off (the Makefile's
# LLAMA_CPP_CMAKE_ARGS, passed in as CMAKE_ARGS; the defaults below are the same).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${TREADLE_CACHE:-$HOME/.cache/treadle}/llama-server-$VERSION"
BINARY="$CACHE/build/bin/llama-server"
PYTHON="${PYTHON:-.venv/bin/python}"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"

if [ -x "$BINARY" ]; then
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
cmake -S "$CACHE/src/vendor/llama.cpp" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    $CMAKE_ARGS >&2
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
echo "$BINARY"
