"""Scalar math for nopython kernels that LLVM can vectorise: float bit casts, half floats and expf.

`math.exp` compiles to a libm call, which LLVM cannot vectorise without a vector math library;
`exp_f32` is plain arithmetic (Cephes expf: range reduction and a degree-6 polynomial, ~1 ulp),
so loops over it run 16 lanes wide, and it gives the same bits in every lane and every call.

numba has no float16 arrays on the CPU, so a half-precision KV cache is stored as uint16 bit
patterns and converted with LLVM's own `half` type: `fpext`/`fptrunc` are exact IEEE conversions
(round to nearest even) that compile to `vcvtph2ps`/`vcvtps2ph`, 16 lanes at a time, in loops.
`as_f32` and `like` let one kernel body serve float32 and float16 caches alike.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # ln 2 split in two: n · LN2_HI is exact for |n| < 2^9
LN2_LO = np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.0)  # expf underflows below this; exp_f32 returns exactly 0 there
EXP_MAX = np.float32(88.0)
# Cephes expf's polynomial in r, highest power first (exp_f32 below; kvcache.attention_simd's vector copy)
EXP_POLYNOMIAL = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                               1.6666665459e-1, 5.0000001201e-1))


@intrinsic
def u32_bits_to_f32(typingctx, bits):  # type: ignore[no-untyped-def]
    """Reinterpret a 32-bit integer's bits as a float32."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        value = args[0]
        if bits.bitwidth != 32:
            value = builder.trunc(value, ir.IntType(32)) if bits.bitwidth > 32 else builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return sig, codegen


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def exp_f32(x):  # type: ignore[no-untyped-def]
    """e**x for float32 x; exactly 0 below -87 (so exp(-inf) = 0, as a running maximum's start needs)."""
    clamped = min(max(x, EXP_MIN), EXP_MAX)
    n = np.floor(clamped * LOG2E + np.float32(0.5))
    r = clamped - n * LN2_HI - n * LN2_LO
    p = EXP_POLYNOMIAL[0]
    p = p * r + EXP_POLYNOMIAL[1]
    p = p * r + EXP_POLYNOMIAL[2]
    p = p * r + EXP_POLYNOMIAL[3]
    p = p * r + EXP_POLYNOMIAL[4]
    p = p * r + EXP_POLYNOMIAL[5]
    p = p * r * r + r + np.float32(1.0)
    two_to_n = u32_bits_to_f32(np.uint32(np.int32(n) + 127) << 23)
    return p * two_to_n if x >= EXP_MIN else np.float32(0.0)


def _half_bits_to_float(builder: ir.IRBuilder, bits: ir.Value, bitwidth: int) -> ir.Value:
    """fp16 bits (the low 16 of an integer) → float32: `fpext` from LLVM's half, i.e. vcvtph2ps."""
    as_i16 = builder.trunc(bits, ir.IntType(16)) if bitwidth > 16 else bits
    return builder.fpext(builder.bitcast(as_i16, ir.HalfType()), ir.FloatType())


@intrinsic
def f16_bits_to_f32(typingctx, bits):  # type: ignore[no-untyped-def]
    """An fp16 bit pattern held in an integer → float32."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 16:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return _half_bits_to_float(builder, args[0], bits.bitwidth)

    return types.float32(bits), codegen


@intrinsic
def as_f32(typingctx, value):  # type: ignore[no-untyped-def]
    """A cache element as float32: a float32 as is, a uint16 as the half float its bits encode."""
    if value == types.float32:
        return types.float32(value), lambda context, builder, signature, args: args[0]
    if value == types.uint16:
        return types.float32(value), lambda context, builder, signature, args: _half_bits_to_float(
            builder, args[0], 16)
    if value == types.int8:  # an int8 cache's value, before its group's scale
        return types.float32(value), lambda context, builder, signature, args: builder.sitofp(
            args[0], ir.FloatType())
    return None


@intrinsic
def like(typingctx, value, sample):  # type: ignore[no-untyped-def]
    """A float32 stored as `sample`'s type: unchanged for float32, half-float bits for uint16."""
    if value != types.float32:
        return None
    if sample == types.float32:
        return types.float32(value, sample), lambda context, builder, signature, args: args[0]
    if sample == types.uint16:
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.uint16(value, sample), codegen
    if sample == types.int8:  # typed for one kernel body, never run: int8 caches are written by group
        return types.int8(value, sample), lambda context, builder, signature, args: builder.fptosi(
            args[0], ir.IntType(8))
    return None


@intrinsic
def flip_sign_bit(typingctx, x):  # type: ignore[no-untyped-def]
    """An int8 cache's key byte, stored as k + 128 (`vpdpbusd`'s unsigned operand), back to k: the
    top bit flipped. Any other type passes unchanged (typed for one kernel body, never run)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if signature.args[0] == types.int8:
            return builder.xor(args[0], ir.Constant(ir.IntType(8), -128))
        return args[0]

    return x(x), codegen


@intrinsic
def is_int8(typingctx, sample):  # type: ignore[no-untyped-def]
    """True for an int8 cache element, as a constant the compiler folds: one kernel body serves every
    cache type, and the branches of the others vanish from each compiled copy."""
    answer = sample == types.int8

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return context.get_constant(types.boolean, answer)

    return types.boolean(sample), codegen


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def round_half_away(x):  # type: ignore[no-untyped-def]
    """round(x) with halves away from zero (C's roundf), as an int32."""
    return np.int32(np.floor(x + np.float32(0.5))) if x >= 0 else -np.int32(np.floor(-x + np.float32(0.5)))


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def f32_to_f16_bits(x):  # type: ignore[no-untyped-def]
    """float32 → the bits of the nearest fp16 (round to nearest even), as a uint16."""
    return like(np.float32(x), np.uint16(0))
