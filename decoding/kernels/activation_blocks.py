"""A 32-value block of activations to int8 in vector IR: its largest magnitude, then its bytes in the kernels'
step order and the sums of its two halves.

numba compiles such a block loop to scalar code, one value at a time (~3-4 ns a value, a few percent of a
prompt's step at 8,960-wide hidden rows). As vectors a block is a load, an absolute value and a reduction,
then a multiply, the rounding, a conversion, one shuffle into the step order and a store. The arithmetic is
q8_0's, operation for operation (a float32 multiply by the block's inverse scale, ±0.5, truncation: llama.cpp's
roundf), so the bytes and sums are those of the scalar form (tests/test_fast_kernels.py holds them to numpy's).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .repack import ACTIVATION_ORDER
from .vnni import array_byte_pointer, lane_mask, load_at, splat, vec

BLOCK = 32

_i8, _i32, _i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()


def _contiguous_1d(array_type: types.Type, dtype: types.Type) -> bool:
    return isinstance(array_type, types.Array) and array_type.ndim == 1 and array_type.layout == "C" and \
        array_type.dtype == dtype


def _load_block(context, builder, x_type, x, base: ir.Value) -> ir.Value:
    """The 32 float32 values from x[base] on."""
    return load_at(builder, array_byte_pointer(context, builder, x_type, x), builder.mul(base, ir.Constant(_i64, 4)),
                   vec(_f32, BLOCK), align=4)


@intrinsic
def block_abs_max(typingctx, x, base):
    """max |x[base + j]| over the block's 32 values (x: contiguous float32; no NaN)."""
    if not _contiguous_1d(x, types.float32) or not isinstance(base, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        values = _load_block(context, builder, x, args[0], context.cast(builder, args[1], base, types.int64))
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec(_f32, BLOCK), [vec(_f32, BLOCK)]),
                                              "llvm.fabs.v32f32")
        reduce_max = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_f32, [vec(_f32, BLOCK)]),
                                                    "llvm.vector.reduce.fmax.v32f32")
        return builder.call(reduce_max, [builder.call(fabs, [values])])

    return types.float32(x, base), codegen


@intrinsic
def quantize_block(typingctx, x, base, inverse, xq, xsum, block):
    """x[base:base + 32] × inverse, rounded half away from zero, into xq[base:base + 32] in the kernels' step
    order (repack.ACTIVATION_ORDER); xsum[block, 0] and xsum[block, 1] the sums of values 0..15 and 16..31."""
    if not (_contiguous_1d(x, types.float32) and _contiguous_1d(xq, types.int8) and isinstance(xsum, types.Array)
            and xsum.ndim == 2 and xsum.layout == "C" and xsum.dtype == types.int32):
        return None

    def codegen(context, builder, signature, args):
        x_value, base_value, inverse_value, xq_value, xsum_value, block_value = args
        base64 = context.cast(builder, base_value, base, types.int64)
        block64 = context.cast(builder, block_value, block, types.int64)
        scale = context.cast(builder, inverse_value, inverse, types.float32)
        scaled = builder.fmul(_load_block(context, builder, x, x_value, base64), splat(builder, scale, BLOCK))
        half = ir.Constant(vec(_f32, BLOCK), [0.5] * BLOCK)
        nonnegative = builder.fcmp_ordered(">=", scaled, ir.Constant(vec(_f32, BLOCK), [0.0] * BLOCK))
        rounded = builder.select(nonnegative, builder.fadd(scaled, half), builder.fsub(scaled, half))
        q = builder.fptosi(rounded, vec(_i32, BLOCK))

        reduce_add = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i32, [vec(_i32, 16)]),
                                                    "llvm.vector.reduce.add.v16i32")
        sums = array_byte_pointer(context, builder, xsum, xsum_value)
        for half_index in range(2):
            lanes = builder.shuffle_vector(q, q, lane_mask(list(range(16 * half_index, 16 * half_index + 16))))
            offset = builder.add(builder.mul(block64, ir.Constant(_i64, 8)), ir.Constant(_i64, 4 * half_index))
            target = builder.bitcast(builder.gep(sums, [offset]), _i32.as_pointer())
            builder.store(builder.call(reduce_add, [lanes]), target)

        ordered = builder.trunc(builder.shuffle_vector(q, q, lane_mask(ACTIVATION_ORDER.tolist())), vec(_i8, BLOCK))
        target = builder.gep(array_byte_pointer(context, builder, xq, xq_value), [base64])
        builder.store(ordered, builder.bitcast(target, vec(_i8, BLOCK).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(x, base, inverse, xq, xsum, block), codegen
