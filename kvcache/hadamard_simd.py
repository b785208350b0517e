"""The Walsh-Hadamard transform of 32 float32 values as LLVM vector IR (a numba intrinsic).

Written as numba loops, the butterflies of strides 1, 2 and 4 run element by element (loops of one to
four iterations do not vectorise). Here the 32 values are two `<16 x float>` vectors: each stage within
a vector is a lane shuffle, a multiply by ±1 and an add; the stride-16 stage adds and subtracts the
two vectors.

Every lane gets exactly the scalar butterfly's operations in its order (stage 1, 2, 4, 8, 16, then the
1/√32 scale; x·(−1) + y is y − x exactly), so the result is bit for bit the scalar transform's.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

HADAMARD_SIZE = 32
_LANES = 16
_f32, _i32 = ir.FloatType(), ir.IntType(32)
_V = ir.VectorType(_f32, _LANES)
_NORM = float(np.float32(1.0 / np.sqrt(HADAMARD_SIZE)))  # the scalar transform's float32 factor


def _const(values: list[float]) -> ir.Constant:
    return ir.Constant(_V, values)


def _partner_shuffle(stride: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(_i32, _LANES), [lane ^ stride for lane in range(_LANES)])


def _stage(builder: ir.IRBuilder, x: ir.Value, stride: int) -> ir.Value:
    """Lane j: x[j] + x[j ^ stride] where bit `stride` of j is clear, x[j ^ stride] − x[j] where set."""
    partner = builder.shuffle_vector(x, ir.Constant(_V, ir.Undefined), _partner_shuffle(stride))
    signs = _const([-1.0 if lane & stride else 1.0 for lane in range(_LANES)])
    return builder.fadd(builder.fmul(x, signs), partner)


@intrinsic
def hadamard32(typingctx, row, first):  # type: ignore[no-untyped-def]
    """row[first:first + 32] ← its orthonormal Walsh-Hadamard transform, in place. `row` is a
    C-contiguous float32 vector (read by pointer); the caller keeps first + 32 within it."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.float32 and row.layout == "C"):
        raise TypingError(f"hadamard32 reads a C-contiguous float32 vector by pointer; got {row}")
    if not isinstance(first, types.Integer):
        raise TypingError(f"hadamard32's offset must be an integer; got {first}")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array = context.make_array(signature.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        low_pointer = builder.bitcast(builder.gep(array.data, [offset]), _V.as_pointer())
        high_pointer = builder.bitcast(builder.gep(array.data, [builder.add(offset, offset.type(_LANES))]),
                                       _V.as_pointer())  # fmt: skip
        low, high = builder.load(low_pointer, align=4), builder.load(high_pointer, align=4)
        for stride in (1, 2, 4, 8):
            low, high = _stage(builder, low, stride), _stage(builder, high, stride)
        low, high = builder.fadd(low, high), builder.fsub(low, high)
        norm = _const([_NORM] * _LANES)
        builder.store(builder.fmul(low, norm), low_pointer, align=4)
        builder.store(builder.fmul(high, norm), high_pointer, align=4)
        return context.get_dummy_value()

    return types.void(row, first), codegen
