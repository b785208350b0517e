"""Bit-level conversions for nopython code: fp16 and bf16 bit patterns to float32.

numba has no float16 type on the CPU, so half-precision values (Q4/Q8 block scales, F16 weights)
stay uint16 in memory and are widened here. The fp16 conversion is an LLVM `fpext` from `half`,
which compiles to the CPU's F16C instruction (vcvtph2ps) instead of a bit-twiddling routine; it
lives in kvcache.fastmath, beside the KV cache's half-float conversions that share its codegen.
"""

from __future__ import annotations

from numba import njit

from kvcache.fastmath import f16_bits_to_f32, u32_bits_to_f32

__all__ = ["bf16_bits_to_f32", "f16_bits_to_f32", "load_f16"]


@njit(inline="always", nogil=True, cache=True)
def bf16_bits_to_f32(bits):  # type: ignore[no-untyped-def]
    """uint16 bf16 bit pattern → float32: bf16 is the upper half of an fp32."""
    return u32_bits_to_f32((bits & 0xFFFF) << 16)


@njit(inline="always", nogil=True, cache=True)
def load_f16(data, offset):  # type: ignore[no-untyped-def]
    """fp16 stored little-endian at data[offset:offset+2] (uint8 array) → float32."""
    return f16_bits_to_f32(data[offset] | (data[offset + 1] << 8))
