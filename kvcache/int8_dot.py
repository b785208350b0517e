"""The int8 dot-product step of the `fast` kernels and the int8 KV cache's attention, as LLVM IR:
`vpdpbusd` (AVX-512 VNNI) where the CPU has it, the same integers from AVX2 or plain vector IR elsewhere.
"""

from __future__ import annotations

import os

from llvmlite import binding, ir
from numba.core import cgutils

_i8, _i16, _i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)

# Without VNNI the same integer dot products are written in plain vector IR (slower, identical results),
# so the kernels compile on every x86-64 CPU; numba's cache is keyed by the host CPU anyway.
# TREADLE_NO_VNNI=1 forces the plain-IR path (to test it on a VNNI machine; use a fresh NUMBA_CACHE_DIR).
HAS_VNNI = bool(binding.get_host_cpu_features().get("avx512vnni", False)) and not os.environ.get("TREADLE_NO_VNNI")
# Without VNNI, AVX2's vpmaddubsw + vpmaddwd (llama.cpp's AVX2 path) where no pair of products can
# saturate 16 bits; TREADLE_NO_AVX2=1 forces the plain-IR path.
HAS_AVX2 = bool(binding.get_host_cpu_features().get("avx2", False)) and not os.environ.get("TREADLE_NO_AVX2")


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _mask(values: list[int]) -> ir.Constant:
    return ir.Constant(_vec(_i32, len(values)), values)


def dpbusd_emitter(builder: ir.IRBuilder, unsigned_max: int = 255):
    """acc + Σ over each 4 bytes of (unsigned a) · (signed b), exact in int32: `vpdpbusd`; else, with
    AVX2, `vpmaddubsw` then `vpmaddwd` against ones where a pair of products cannot pass 16 bits
    (a ≤ `unsigned_max` ≤ 127 against |b| ≤ 128), or both operands widened to 16 bits and `vpmaddwd`;
    else plain vector IR. All give the same integers."""
    if HAS_VNNI:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_vec(_i32, 16), [_vec(_i32, 16), _vec(_i8, 64), _vec(_i8, 64)]),
            "llvm.x86.avx512.vpdpbusd.512",
        )
        return lambda acc, a, b: builder.call(fn, [acc, a, b])
    if HAS_AVX2:
        return _avx2_dpbusd(builder, unsigned_max)

    def emulate(acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        products = builder.mul(builder.zext(a, _vec(_i32, 64)), builder.sext(b, _vec(_i32, 64)))
        for k in range(4):
            acc = builder.add(acc, builder.shuffle_vector(products, products, _mask([4 * i + k for i in range(16)])))
        return acc

    return emulate


def _avx2_dpbusd(builder: ir.IRBuilder, unsigned_max: int):
    maddubs = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_i16, 16), [_vec(_i8, 32), _vec(_i8, 32)]), "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_i32, 8), [_vec(_i16, 16), _vec(_i16, 16)]), "llvm.x86.avx2.pmadd.wd")
    ones16 = ir.Constant(_vec(_i16, 16), [1] * 16)

    def part(v: ir.Value, first: int, n: int) -> ir.Value:
        return builder.shuffle_vector(v, v, _mask(list(range(first, first + n))))

    def join(low: ir.Value, high: ir.Value, n: int) -> ir.Value:
        return builder.shuffle_vector(low, high, _mask(list(range(2 * n))))

    if unsigned_max <= 127:  # |a0·b0 + a1·b1| ≤ 2 · 127 · 128 < 2^15: vpmaddubsw is exact

        def narrow(acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
            quads = [builder.call(maddwd, [builder.call(maddubs, [part(a, h, 32), part(b, h, 32)]), ones16])
                     for h in (0, 32)]  # fmt: skip
            return builder.add(acc, join(quads[0], quads[1], 8))

        return narrow

    def wide(acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        pairs = [builder.call(maddwd, [builder.zext(part(a, q, 16), _vec(_i16, 16)),
                                       builder.sext(part(b, q, 16), _vec(_i16, 16))])
                 for q in (0, 16, 32, 48)]  # fmt: skip
        pairs32 = join(join(pairs[0], pairs[1], 8), join(pairs[2], pairs[3], 8), 16)  # sums of byte pairs
        even = builder.shuffle_vector(pairs32, pairs32, _mask(list(range(0, 32, 2))))
        odd = builder.shuffle_vector(pairs32, pairs32, _mask(list(range(1, 32, 2))))
        return builder.add(acc, builder.add(even, odd))

    return wide
