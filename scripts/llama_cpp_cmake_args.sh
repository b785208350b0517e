#!/usr/bin/env bash
# The CMake options llama.cpp is built with for the benchmarks here: every x86 instruction set this
# CPU lists, named one by one, and AMX off.
#
#   scripts/llama_cpp_cmake_args.sh      # prints the options
#
# Not GGML_NATIVE: on Intel guests that list AMX without granting its state, a native build segfaults
# on its first multi-token batch. Not a fixed list either: AVX-512 options on an AMD EPYC guest that
# has only AVX2 (Zen 3) build a binary that dies of an illegal instruction.
set -euo pipefail

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
option() {  # option NAME CPU_FLAG: ON where the CPU lists the flag
    if [[ "$flags" == *" $2 "* ]]; then echo -n "-D$1=ON "; else echo -n "-D$1=OFF "; fi
}
echo -n "-DGGML_NATIVE=OFF "
option GGML_AVX avx
option GGML_AVX2 avx2
option GGML_FMA fma
option GGML_F16C f16c
option GGML_BMI2 bmi2
option GGML_AVX_VNNI avx_vnni
option GGML_AVX512 avx512f
option GGML_AVX512_VBMI avx512vbmi
option GGML_AVX512_VNNI avx512_vnni
option GGML_AVX512_BF16 avx512_bf16
echo "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
