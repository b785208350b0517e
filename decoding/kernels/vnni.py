"""AVX-512 VNNI dot products of repacked quantized weights with int8 activations (the `fast` kernels).

numba never emits `vpdpbusd` on its own (MEASURED.md), so each kernel here is an LLVM IR loop
written with llvmlite and exposed to nopython code as an intrinsic. One call computes 8 weight rows
(an interleaved group, see decoding.kernels.repack) against 1, 4 or 8 tokens, and stores 8 float32 results
per token.

Per 32-weight block and 8 rows, four `vpdpbusd`s multiply unsigned weight bytes with signed
activation bytes and sum groups of four into 16 int32 lanes (two lanes per row: weights 0..15 and
16..31 of the block). Each row's two lanes are added in integers (two tokens' rows a vector), the
row's sum is scaled in float32 once per block — weight scale × activation scale — and joins the
accumulator in one fused multiply-add; the Q4_1 min term adds m · (d_x · Σq_x), the activation's
mass, quantized beside it. Unsigned storage offsets (nibble − 8 for Q4_0, byte + 128 for Q8_0) are
taken back exactly in integers: each lane starts from −offset × the Σq_x of its half of the block,
also computed once per activation row, so a token costs a block four `vpdpbusd`s, a shuffle, and
half of a conversion and two or three float operations. Q5_0 is Q4_0 (and Q5_1 is Q4_1) with a
fifth bit: its nibbles take 16 more where the bit is set (`_fifth_bits_vector`), and 16 is its
storage offset. Q6_K runs in a form of its own: Q4_0's nibbles with each weight's top two bits
beside them (`_high_bits_vector`, q6 with offset 32) and a scale per 16 weights, one per lane, so
its lanes are scaled one by one and each row's pair added at the end. Q4_K keeps its own 4.5-bit
economy nearly whole (4.625 bits): each super-block of 8 blocks opens with the 8 rows' fp16 d and
dmin (32 B), then each block has Q4_0's nibbles and each row's 6-bit sub-block scale and min as a
byte each; the kernel forms d·scale and dmin·min in float32 per block, then runs as Q4_1. Every
token's arithmetic is the same sequence of operations whether it is computed alone or with three or
seven others, so results are batch-invariant.
"""

from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvcache.int8_dot import dpbusd_emitter

from ..model.quant import QType

LANES = 16
GROUP_ROWS = 8
MOST_GROUP_TOKENS = 8  # the widest call: results are (MOST_GROUP_TOKENS, GROUP_ROWS) float32
# bytes of one (8-row group, 32-weight block) in the repacked stream, and where its scales start
BLOCK_STRIDE = {QType.Q4_0: 144, QType.Q4_1: 160, QType.Q5_0: 176, QType.Q5_1: 192, QType.Q8_0: 272,
                QType.Q6_K: 224, QType.Q4_K: 148}  # Q4_K: 144 a block and its share of the super-block's 32
SCALE_OFFSET = {QType.Q4_0: 128, QType.Q4_1: 128, QType.Q5_0: 160, QType.Q5_1: 160, QType.Q8_0: 256,
                QType.Q6_K: 192, QType.Q4_K: 128}
MIN_OFFSET = {QType.Q4_1: 144, QType.Q5_1: 176, QType.Q4_K: 136}  # the types with a min term
# Q4_K: a super-block of 8 blocks is a 32-byte header (row r's fp16 d and dmin at 4r) and 8 blocks of
# 144 bytes: the nibbles, then one byte per row of sub-block scale (SCALE_OFFSET) and of min (MIN_OFFSET)
K_SUPER_BLOCKS = 8
K_HEADER_BYTES = 32
K_BLOCK_BYTES = 144
FIFTH_BITS_OFFSET = 128  # Q5_0 and Q5_1: 4 steps × 8 rows × one byte of fifth bits
HIGH_BITS_OFFSET = 128  # Q6_K: 4 steps × 16 bytes, each holding the top two bits of four weights
UNSIGNED_BIAS = {QType.Q4_0: 8, QType.Q5_0: 16, QType.Q8_0: 128, QType.Q4_1: 0, QType.Q5_1: 0, QType.Q6_K: 32,
                 QType.Q4_K: 0}
# Q6_K's form has a scale per 16 weights, one per lane: lane 2r holds row r's weights 0..15 of the
# block, lane 2r+1 its weights 16..31 (the step order of decoding.kernels.repack)
HALF_SCALES = (QType.Q6_K,)
# how far ahead of its block a kernel asks for weights (every line of the block that far on): ~28 blocks
# of Q4_K, ~300 ns of an 8-token call, past the DRAM latency. At 8 tokens the step is compute-bound only
# if the weights arrive while the kernel works; with the hardware prefetcher alone (or 1 KiB ahead) it
# waited for them, and one token streams ~9% faster with it too (docs/performance.md).
PREFETCH_AHEAD = 4096

_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()

def vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def lane_mask(values: list[int]) -> ir.Constant:
    return ir.Constant(vec(_i32, len(values)), values)


def splat(builder: ir.IRBuilder, value: ir.Value, n: int) -> ir.Value:
    single = builder.insert_element(ir.Constant(vec(value.type, n), None), value, ir.Constant(_i32, 0))
    return builder.shuffle_vector(single, single, lane_mask([0] * n))


def load_at(builder: ir.IRBuilder, byte_ptr: ir.Value, offset: ir.Value | int, ty: ir.Type, align: int = 1) -> ir.Value:
    if isinstance(offset, int):
        offset = ir.Constant(_i64, offset)
    ptr = builder.gep(byte_ptr, [offset])
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)


def array_byte_pointer(context, builder, arr_type, arr_value) -> ir.Value:
    array = context.make_array(arr_type)(context, builder, arr_value)
    return builder.bitcast(array.data, _i8.as_pointer())


def _row_stride_bytes(context, builder, arr_type, arr_value) -> ir.Value:
    """Bytes between rows of a 2-D array (scratch arrays are wider than the matrix being used)."""
    array = context.make_array(arr_type)(context, builder, arr_value)
    return cgutils.unpack_tuple(builder, array.strides)[0]


def weight_vector(builder: ir.IRBuilder, qtype: QType, block_ptr: ir.Value, step: int) -> ir.Value:
    """The 64 unsigned weight bytes of step `step` (0..3) of a block: 8 bytes for each of 8 rows."""
    if qtype == QType.Q8_0:
        return load_at(builder, block_ptr, 64 * step, vec(_i8, 64))
    packed = load_at(builder, block_ptr, 32 * step, vec(_i8, 32))  # 4 bytes of nibbles per row
    low = builder.and_(packed, ir.Constant(vec(_i8, 32), [15] * 32))
    high = builder.lshr(packed, ir.Constant(vec(_i8, 32), [4] * 32))
    low32 = builder.bitcast(low, vec(_i32, 8))
    high32 = builder.bitcast(high, vec(_i32, 8))
    # row r's two lanes: its 4 low nibbles (weights 4s..4s+3), then its 4 high ones (16+4s..16+4s+3)
    interleaved = builder.shuffle_vector(low32, high32, lane_mask([i // 2 + (8 if i % 2 else 0) for i in range(16)]))
    weights = builder.bitcast(interleaved, vec(_i8, 64))
    if qtype in (QType.Q5_0, QType.Q5_1):
        weights = builder.or_(weights, _fifth_bits_vector(builder, block_ptr, step))
    elif qtype == QType.Q6_K:
        weights = builder.or_(weights, _high_bits_vector(builder, block_ptr, step))
    return weights


def _high_bits_vector(builder: ir.IRBuilder, block_ptr: ir.Value, step: int) -> ir.Value:
    """Q6_K: each weight's top two bits, moved to bits 4 and 5, in the 64 bytes' order. Byte p of the
    step's 16 holds in its bits 2j, 2j+1 those of weight byte 16j + p (decoding.kernels.repack), so four
    uniform shifts and masks of one 16-byte vector, then two concatenations, place them all."""
    packed = load_at(builder, block_ptr, HIGH_BITS_OFFSET + 16 * step, vec(_i8, 16))
    mask = ir.Constant(vec(_i8, 16), [0x30] * 16)
    parts = []
    for j in range(4):
        shift = 4 - 2 * j  # bits 2j, 2j+1 → bits 4, 5
        if shift > 0:
            moved = builder.shl(packed, ir.Constant(vec(_i8, 16), [shift] * 16))
        elif shift < 0:
            moved = builder.lshr(packed, ir.Constant(vec(_i8, 16), [-shift] * 16))
        else:
            moved = packed
        parts.append(builder.and_(moved, mask))
    low = builder.shuffle_vector(parts[0], parts[1], lane_mask(list(range(32))))
    high = builder.shuffle_vector(parts[2], parts[3], lane_mask(list(range(32))))
    return builder.shuffle_vector(low, high, lane_mask(list(range(64))))


def _fifth_bits_vector(builder: ir.IRBuilder, block_ptr: ir.Value, step: int) -> ir.Value:
    """Q5_0: 16 where a weight's fifth bit is set, in the 64 bytes' order. Byte r of the step holds
    row r's eight bits, bit k for the weight in byte k of the row's 8 (decoding.kernels.repack)."""
    bits = load_at(builder, block_ptr, FIFTH_BITS_OFFSET + 8 * step, vec(_i8, 8))
    spread = builder.shuffle_vector(bits, bits, lane_mask([i // 8 for i in range(64)]))  # row r's byte × 8
    bit_of_lane = ir.Constant(vec(_i8, 64), [(1 << (i % 8)) if i % 8 < 7 else -128 for i in range(64)])
    zero = ir.Constant(vec(_i8, 64), [0] * 64)
    is_set = builder.icmp_unsigned("!=", builder.and_(spread, bit_of_lane), zero)
    return builder.select(is_set, ir.Constant(vec(_i8, 64), [16] * 64), zero)


# the largest unsigned byte each type's weights put into a dot product (its storage offset's range)
UNSIGNED_MAX = {QType.Q4_0: 15, QType.Q4_1: 15, QType.Q5_0: 31, QType.Q5_1: 31, QType.Q6_K: 63, QType.Q8_0: 255,
                QType.Q4_K: 15}


def _k_block_pointers(builder: ir.IRBuilder, w_base: ir.Value, block: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Q4_K: (the block's bytes, its super-block's header)."""
    super_bytes = K_HEADER_BYTES + K_SUPER_BLOCKS * K_BLOCK_BYTES
    first = builder.mul(builder.lshr(block, ir.Constant(_i64, 3)), ir.Constant(_i64, super_bytes))
    header = builder.gep(w_base, [first])
    within = builder.mul(builder.and_(block, ir.Constant(_i64, K_SUPER_BLOCKS - 1)), ir.Constant(_i64, K_BLOCK_BYTES))
    return builder.gep(header, [builder.add(within, ir.Constant(_i64, K_HEADER_BYTES))]), header


def _k_scales_and_mins(builder: ir.IRBuilder, block_ptr: ir.Value, header: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Q4_K: the 8 rows' d·scale and −dmin·min of this block, float32 (8 lanes each)."""
    sub_scales = builder.uitofp(load_at(builder, block_ptr, SCALE_OFFSET[QType.Q4_K], vec(_i8, 8)), vec(_f32, 8))
    sub_mins = builder.uitofp(load_at(builder, block_ptr, MIN_OFFSET[QType.Q4_K], vec(_i8, 8)), vec(_f32, 8))
    halves = builder.fpext(builder.bitcast(load_at(builder, header, 0, vec(_i16, 16)), vec(ir.HalfType(), 16)),
                           vec(_f32, 16))  # fmt: skip
    d = builder.shuffle_vector(halves, halves, lane_mask(list(range(0, 16, 2))))
    dmin = builder.shuffle_vector(halves, halves, lane_mask(list(range(1, 16, 2))))
    return builder.fmul(d, sub_scales), builder.fneg(builder.fmul(dmin, sub_mins))


def block_scales(builder: ir.IRBuilder, qtype: QType, w_base: ir.Value, block: ir.Value):
    """(the bytes of one 8-row group's block, its scales, its mins or None). A HALF_SCALES type has 16 lane
    scales, lanes 2r and 2r+1 row r's weights 0..15 and 16..31, and no mins; every other type one scale and
    min per row (8 lanes)."""
    mins = None
    if qtype == QType.Q4_K:
        block_ptr, k_header = _k_block_pointers(builder, w_base, block)
        scales, mins = _k_scales_and_mins(builder, block_ptr, k_header)
        return block_ptr, scales, mins
    block_ptr = builder.gep(w_base, [builder.mul(block, ir.Constant(_i64, BLOCK_STRIDE[qtype]))])
    width = 16 if qtype in HALF_SCALES else 8
    scales = builder.fpext(builder.bitcast(load_at(builder, block_ptr, SCALE_OFFSET[qtype], vec(_i16, width)),
                                           vec(ir.HalfType(), width)), vec(_f32, width))  # fmt: skip
    if qtype in MIN_OFFSET:
        mins = builder.fpext(builder.bitcast(load_at(builder, block_ptr, MIN_OFFSET[qtype], vec(_i16, 8)),
                                             vec(ir.HalfType(), 8)), vec(_f32, 8))
    return block_ptr, scales, mins


def row_sums(builder: ir.IRBuilder, first: ir.Value, second: ir.Value) -> ir.Value:
    """Each row's two int32 lanes (2r, 2r+1) added: the 8 rows of `first`, then the 8 of `second`."""
    even = builder.shuffle_vector(first, second, lane_mask(list(range(0, 32, 2))))
    odd = builder.shuffle_vector(first, second, lane_mask(list(range(1, 32, 2))))
    return builder.add(even, odd)


def prefetch_ahead(builder: ir.IRBuilder, qtype: QType, block_ptr: ir.Value) -> None:
    """Ask for every line of the bytes PREFETCH_AHEAD past this block's (a read, kept in every cache level):
    the weights a kernel will reach ~300 ns from now, so they arrive while it computes."""
    prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [_i8.as_pointer(), _i32, _i32, _i32]), "llvm.prefetch.p0i8")
    for line in range(-(-BLOCK_STRIDE[qtype] // 64)):
        ahead = ir.Constant(_i64, PREFETCH_AHEAD + 64 * line)
        builder.call(prefetch, [builder.gep(block_ptr, [ahead]), ir.Constant(_i32, 0), ir.Constant(_i32, 3),
                                ir.Constant(_i32, 1)])


def fused_multiply_add(builder: ir.IRBuilder):
    """a · b + c on float32 × 16, rounded once (`vfmadd`): the block's products join the accumulator in one
    instruction where a multiply and an add took two, and every kernel that must agree with these to the
    bit (the tiles' epilogue) uses it too."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec(_f32, LANES), [vec(_f32, LANES)] * 3),
                                          "llvm.fma.v16f32")


class BlockLoop(NamedTuple):
    entry: ir.Block
    loop: ir.Block
    done: ir.Block
    block: ir.Value  # the block index, 0..n_blocks-1
    accs: list[ir.Value]  # the float32 × 16 accumulators' values at the top of the body


def open_block_loop(builder: ir.IRBuilder, n_blocks: ir.Value, n_accs: int) -> BlockLoop:
    """A loop over the blocks (none when n_blocks <= 0) carrying `n_accs` float32 × 16 accumulators from 0,
    positioned at the top of its body."""
    entry = builder.block
    loop = builder.append_basic_block("blocks")
    done = builder.append_basic_block("done")
    builder.cbranch(builder.icmp_signed(">", n_blocks, ir.Constant(_i64, 0)), loop, done)
    builder.position_at_end(loop)
    block = builder.phi(_i64)
    block.add_incoming(ir.Constant(_i64, 0), entry)
    accs = []
    for _ in range(n_accs):
        acc = builder.phi(vec(_f32, LANES))
        acc.add_incoming(ir.Constant(vec(_f32, LANES), [0.0] * LANES), entry)
        accs.append(acc)
    return BlockLoop(entry, loop, done, block, accs)


def close_block_loop(builder: ir.IRBuilder, blocks: BlockLoop, n_blocks: ir.Value,
                     next_accs: list[ir.Value]) -> list[ir.Value]:  # fmt: skip
    """End the body (each accumulator takes its next value), position after the loop and return each
    accumulator's final value (0 where the loop did not run)."""
    next_block = builder.add(blocks.block, ir.Constant(_i64, 1))
    blocks.block.add_incoming(next_block, blocks.loop)
    for acc, nxt in zip(blocks.accs, next_accs, strict=True):
        acc.add_incoming(nxt, blocks.loop)
    builder.cbranch(builder.icmp_signed("<", next_block, n_blocks), blocks.loop, blocks.done)
    builder.position_at_end(blocks.done)
    finals = []  # phis first: LLVM wants them at the top of the block
    for nxt in next_accs:
        final = builder.phi(vec(_f32, LANES))
        final.add_incoming(ir.Constant(vec(_f32, LANES), [0.0] * LANES), blocks.entry)
        final.add_incoming(nxt, blocks.loop)
        finals.append(final)
    return finals


def _make_group_dot(qtype: QType, num_tokens: int):  # noqa: C901 - one IR loop, written out
    bias = UNSIGNED_BIAS[qtype]

    @intrinsic
    def group_dot(typingctx, weights, weight_offset, num_blocks, xq, xd, xsum, token, out):
        """out[k, 0:8] = the 8 rows of the group at `weight_offset` · activation row token + k.

        weights: (…) uint8 repacked stream; xq: (tokens, 32·num_blocks) int8, reordered per block;
        xd: (tokens, num_blocks, 2) float32 each block's scale d and mass d·Σq; xsum: (tokens, num_blocks, 2)
        int32 Σq over the block's weights 0..15 and 16..31 (decoding.kernels.fast_kernels.activation_arrays);
        out: (≥num_tokens, 8) float32.
        """
        sig = types.void(weights, weight_offset, num_blocks, xq, xd, xsum, token, out)

        def codegen(context, builder, signature, args):
            w_arr, w_off, n_blocks, xq_arr, xd_arr, xs_arr, tok, out_arr = args
            w_off = context.cast(builder, w_off, signature.args[1], types.int64)
            n_blocks = context.cast(builder, n_blocks, signature.args[2], types.int64)
            tok = context.cast(builder, tok, signature.args[6], types.int64)
            w_base = builder.gep(array_byte_pointer(context, builder, signature.args[0], w_arr), [w_off])
            xq_base = array_byte_pointer(context, builder, signature.args[3], xq_arr)
            xd_base = array_byte_pointer(context, builder, signature.args[4], xd_arr)
            xs_base = array_byte_pointer(context, builder, signature.args[5], xs_arr)
            out_base = array_byte_pointer(context, builder, signature.args[7], out_arr)
            out_row_bytes = _row_stride_bytes(context, builder, signature.args[7], out_arr)
            xq_row_bytes = _row_stride_bytes(context, builder, signature.args[3], xq_arr)
            xd_row_bytes = _row_stride_bytes(context, builder, signature.args[4], xd_arr)
            xs_row_bytes = _row_stride_bytes(context, builder, signature.args[5], xs_arr)

            dpbusd = dpbusd_emitter(builder, UNSIGNED_MAX[qtype])
            zero_i = ir.Constant(vec(_i32, LANES), [0] * LANES)
            # a vector of rows scaled at once: two tokens' (lanes 0..7 and 8..15) where the call has pairs of tokens;
            # a lone token's with each row in both of its lanes (an in-lane swap and add: no wider shuffles)
            paired = qtype not in HALF_SCALES and num_tokens > 1
            n_accs = num_tokens // 2 if paired else num_tokens
            fma = fused_multiply_add(builder)

            blocks = open_block_loop(builder, n_blocks, n_accs)
            block, accs = blocks.block, blocks.accs
            block_ptr, scales, mins = block_scales(builder, qtype, w_base, block)
            prefetch_ahead(builder, qtype, block_ptr)
            weight_vectors = [weight_vector(builder, qtype, block_ptr, s) for s in range(4)]
            pair_bytes = builder.mul(block, ir.Constant(_i64, 8))  # xd and xsum hold two 4-byte fields a block
            sums, x_scales, x_masses = [], [], []
            for k in range(num_tokens):
                row = builder.add(tok, ir.Constant(_i64, k))
                x_ptr = builder.gep(xq_base, [builder.add(builder.mul(row, xq_row_bytes),
                                                          builder.mul(block, ir.Constant(_i64, 32)))])
                # the unsigned storage offset taken back before the products are added: Σ(w + bias)·x − bias·Σx,
                # per lane with the Σx of the lane's half of the block (lane 2r: weights 0..15, 2r+1: 16..31)
                if bias:
                    halves = load_at(builder, xs_base, builder.add(builder.mul(row, xs_row_bytes), pair_bytes), _i64,
                                     align=4)
                    acc_i = builder.mul(builder.bitcast(splat(builder, halves, 8), vec(_i32, LANES)),
                                        ir.Constant(vec(_i32, LANES), [-bias] * LANES))
                else:
                    acc_i = zero_i
                for s in range(4):
                    x8 = load_at(builder, x_ptr, 8 * s, _i64)
                    acc_i = dpbusd(acc_i, weight_vectors[s], builder.bitcast(splat(builder, x8, 8), vec(_i8, 64)))
                fields = builder.add(builder.mul(row, xd_row_bytes), pair_bytes)
                sums.append(acc_i)
                x_scales.append(load_at(builder, xd_base, fields, _f32, align=4))
                if mins is not None:
                    x_masses.append(load_at(builder, xd_base, builder.add(fields, ir.Constant(_i64, 4)), _f32, align=4))
            next_accs = []
            if qtype in HALF_SCALES:  # a scale per lane: each lane scaled, the pair added at the end
                for k in range(num_tokens):
                    scaled = builder.fmul(scales, splat(builder, x_scales[k], LANES))
                    next_accs.append(builder.call(fma, [builder.sitofp(sums[k], vec(_f32, LANES)), scaled, accs[k]]))
            else:  # a scale per row: each row's lanes added in integers, then scaled once
                row_of_lane = [i % 8 for i in range(16)] if paired else [i // 2 for i in range(16)]
                row_lanes = builder.shuffle_vector(scales, scales, lane_mask(row_of_lane))
                row_mins = None if mins is None else builder.shuffle_vector(mins, mins, lane_mask(row_of_lane))

                def per_token_lanes(values: list[ir.Value], first: int) -> ir.Value:
                    if not paired:
                        return splat(builder, values[first], LANES)
                    pair = [splat(builder, values[first + h], GROUP_ROWS) for h in range(2)]
                    return builder.shuffle_vector(*pair, lane_mask(list(range(16))))

                for p in range(n_accs):
                    first = 2 * p if paired else p
                    if paired:
                        sum_i = row_sums(builder, sums[first], sums[first + 1])
                    else:  # lane 2r + h: its own and its pair's
                        pair_swapped = lane_mask([i ^ 1 for i in range(16)])
                        sum_i = builder.add(sums[first], builder.shuffle_vector(sums[first], sums[first], pair_swapped))
                    acc = builder.call(fma, [builder.sitofp(sum_i, vec(_f32, LANES)),
                                             builder.fmul(row_lanes, per_token_lanes(x_scales, first)), accs[p]])
                    if row_mins is not None:
                        acc = builder.call(fma, [row_mins, per_token_lanes(x_masses, first), acc])
                    next_accs.append(acc)
            finals = close_block_loop(builder, blocks, n_blocks, next_accs)
            out_rows = []  # (token, its 8 rows)
            even_lanes, odd_lanes = lane_mask(list(range(0, 16, 2))), lane_mask(list(range(1, 16, 2)))
            for p, final in enumerate(finals):
                if qtype in HALF_SCALES:  # row r = lane 2r + lane 2r+1
                    out_rows.append((p, builder.fadd(builder.shuffle_vector(final, final, even_lanes),
                                                     builder.shuffle_vector(final, final, odd_lanes))))  # fmt: skip
                elif paired:
                    for h in range(2):
                        out_rows.append((2 * p + h, builder.shuffle_vector(final, final, lane_mask(
                            list(range(8 * h, 8 * h + 8))))))  # fmt: skip
                else:
                    out_rows.append((p, builder.shuffle_vector(final, final, even_lanes)))
            for k, rows in out_rows:
                out_ptr = builder.gep(out_base, [builder.mul(ir.Constant(_i64, k), out_row_bytes)])
                builder.store(rows, builder.bitcast(out_ptr, vec(_f32, 8).as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return group_dot


group_dot_q4_0_x1 = _make_group_dot(QType.Q4_0, 1)
group_dot_q4_0_x4 = _make_group_dot(QType.Q4_0, 4)
group_dot_q4_0_x8 = _make_group_dot(QType.Q4_0, 8)
group_dot_q4_1_x1 = _make_group_dot(QType.Q4_1, 1)
group_dot_q4_1_x4 = _make_group_dot(QType.Q4_1, 4)
group_dot_q4_1_x8 = _make_group_dot(QType.Q4_1, 8)
group_dot_q4_k_x1 = _make_group_dot(QType.Q4_K, 1)
group_dot_q4_k_x4 = _make_group_dot(QType.Q4_K, 4)
group_dot_q4_k_x8 = _make_group_dot(QType.Q4_K, 8)
group_dot_q5_0_x1 = _make_group_dot(QType.Q5_0, 1)
group_dot_q5_0_x4 = _make_group_dot(QType.Q5_0, 4)
group_dot_q5_0_x8 = _make_group_dot(QType.Q5_0, 8)
group_dot_q5_1_x1 = _make_group_dot(QType.Q5_1, 1)
group_dot_q5_1_x4 = _make_group_dot(QType.Q5_1, 4)
group_dot_q5_1_x8 = _make_group_dot(QType.Q5_1, 8)
group_dot_q6_k_x1 = _make_group_dot(QType.Q6_K, 1)
group_dot_q6_k_x4 = _make_group_dot(QType.Q6_K, 4)
group_dot_q6_k_x8 = _make_group_dot(QType.Q6_K, 8)
group_dot_q8_0_x1 = _make_group_dot(QType.Q8_0, 1)
group_dot_q8_0_x4 = _make_group_dot(QType.Q8_0, 4)
group_dot_q8_0_x8 = _make_group_dot(QType.Q8_0, 8)
