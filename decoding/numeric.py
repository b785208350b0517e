"""Bit-level conversions for nopython code: fp16 and bf16 bit patterns to float32.

numba has no float16 type on the CPU, so half-precision values (Q4/Q8 block scales, F16 weights)
stay uint16 in memory and are widened here. The fp16 conversion is an LLVM `fpext` from `half`,
which compiles to the CPU's F16C instruction (vcvtph2ps) instead of a bit-twiddling routine.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from kvcache.fastmath import u32_bits_to_f32


@intrinsic
def f16_bits_to_f32(typingctx, bits):  # type: ignore[no-untyped-def]
    """uint16 fp16 bit pattern → float32."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        as_i16 = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
        as_half = builder.bitcast(as_i16, ir.HalfType())
        return builder.fpext(as_half, ir.FloatType())

    return sig, codegen


@njit(inline="always", nogil=True, cache=True)
def bf16_bits_to_f32(bits):  # type: ignore[no-untyped-def]
    """uint16 bf16 bit pattern → float32: bf16 is the upper half of an fp32."""
    return u32_bits_to_f32((bits & 0xFFFF) << 16)


@njit(inline="always", nogil=True, cache=True)
def load_f16(data, offset):  # type: ignore[no-untyped-def]
    """fp16 stored little-endian at data[offset:offset+2] (uint8 array) → float32."""
    return f16_bits_to_f32(data[offset] | (data[offset + 1] << 8))
