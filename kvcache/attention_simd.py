"""One block of paged attention for a GQA group's query heads, as LLVM vector IR (numba intrinsics).

The numba kernel's loops run over a block's 16 keys, so LLVM vectorises each of them as one vector
iteration wrapped in run-time alias checks and scalar remainders, many times per block; attention
then cost ~10 ns per key and head. Here the block is explicit `<16 x float>` arithmetic: the 16
scores are one vector accumulated over head_dim, the mask, max, exp and sum act on that vector, and
the weighted sum of value rows runs as passes over the keys, two 16-value chunks of head_dim at a
time, each head's weight for a key broadcast from its row of scratch into fused multiply-adds.

An int8 cache's scores are integer dot products (`vpdpbusd` where the CPU has VNNI): the query is
quantized per group of 32 like a key (`attention.quantize_query_q8`), each quad of key rows is
transposed so that a key's four bytes share a lane, and the exact integer sums are scaled by the
query's and the keys' scales. Its value tile is widened to float32 once a block for the whole group
(`widen_q8_values`), each value times its group's scale.

The arithmetic is the numba kernel's (`attention._block_scores` etc.) in a fixed order of its own,
which depends only on the block's keys: outputs stay independent of the batch, the thread count and
the chunking. `exp` is `fastmath.exp_f32` (Cephes, plain arithmetic) on 16 lanes; keys past
`num_keys` are masked to -inf before the max and never read from the value tile (unused slots of
a block may hold anything).

Every array is read by pointer, assuming C-contiguous tiles and rows: other layouts are refused
when the kernel is typed (`require_c_contiguous`), never misread.

Specialised for 16-key blocks and head_dim 64 or 128; other shapes use the numba path. One call
serves one to four query heads of a group (each K and V row loaded once for all of them);
`attention._attend_group_simd` cuts larger groups into calls of three or four.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from kvcache.fastmath import EXP_MAX, EXP_MIN, EXP_POLYNOMIAL, LN2_HI, LN2_LO, LOG2E
from kvcache.int8_dot import dpbusd_emitter

SIMD_BLOCK_SIZE = 16
_LANES = SIMD_BLOCK_SIZE
_f32, _i8, _i32, _i64, _half = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.HalfType()
Q8_GROUP = 32  # kvcache.storage.Q8_GROUP: int8 values per fp16 scale
_V = ir.VectorType(_f32, _LANES)


def _splat(builder: ir.IRBuilder, scalar: ir.Value) -> ir.Value:
    vector = builder.insert_element(ir.Constant(_V, ir.Undefined), scalar, ir.Constant(_i32, 0))
    return builder.shuffle_vector(vector, ir.Constant(_V, ir.Undefined), ir.Constant(ir.VectorType(_i32, _LANES),
                                                                                     [0] * _LANES))


def _const(value: float) -> ir.Constant:
    return ir.Constant(_V, [float(value)] * _LANES)


def _intrinsic_fn(builder: ir.IRBuilder, name: str, num_args: int) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V, [_V] * num_args), name)


def _exp(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """exp_f32 on 16 lanes, operation for operation (0 below -87, so exp(-inf) = 0)."""
    maxnum, minnum = _intrinsic_fn(builder, "llvm.maxnum.v16f32", 2), _intrinsic_fn(builder, "llvm.minnum.v16f32", 2)
    floor = _intrinsic_fn(builder, "llvm.floor.v16f32", 1)
    clamped = builder.call(minnum, [builder.call(maxnum, [x, _const(EXP_MIN)]), _const(EXP_MAX)])
    n = builder.call(floor, [builder.fadd(builder.fmul(clamped, _const(LOG2E)), _const(0.5))])
    r = builder.fsub(builder.fsub(clamped, builder.fmul(n, _const(LN2_HI))), builder.fmul(n, _const(LN2_LO)))
    p = _const(EXP_POLYNOMIAL[0])
    for coefficient in EXP_POLYNOMIAL[1:]:
        p = builder.fadd(builder.fmul(p, r), _const(coefficient))
    p = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), _const(1.0))
    exponent = builder.shl(builder.add(builder.fptosi(n, ir.VectorType(_i32, _LANES)),
                                       ir.Constant(ir.VectorType(_i32, _LANES), [127] * _LANES)),
                           ir.Constant(ir.VectorType(_i32, _LANES), [23] * _LANES))
    scaled = builder.fmul(p, builder.bitcast(exponent, _V))
    in_range = builder.fcmp_ordered(">=", x, _const(EXP_MIN))
    return builder.select(in_range, scaled, _const(0.0))


def _reduce(builder: ir.IRBuilder, vector: ir.Value, combine) -> ir.Value:  # type: ignore[no-untyped-def]
    """Halve the vector until one lane is left: a fixed tree (lane i with lane i + width / 2)."""
    width = _LANES
    while width > 1:
        width //= 2
        upper = builder.shuffle_vector(vector, ir.Constant(_V, ir.Undefined), ir.Constant(
            ir.VectorType(_i32, _LANES), [i + width if i < width else i for i in range(_LANES)]))
        vector = combine(vector, upper)
    return builder.extract_element(vector, ir.Constant(_i32, 0))


def _load_row(builder: ir.IRBuilder, base: ir.Value, element: ir.Type, index: ir.Value) -> ir.Value:
    """16 consecutive elements from `base` + index elements, as float32 (half floats widened)."""
    pointer = builder.gep(base, [index])
    if element == _half:
        raw = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), _LANES).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(raw, ir.VectorType(_half, _LANES)), _V)
    return builder.load(builder.bitcast(pointer, _V.as_pointer()), align=4)


def _halves_at(builder: ir.IRBuilder, byte_base: ir.Value, byte_offset: ir.Value) -> ir.Value:
    """16 fp16 values at a byte offset (an int8 K tile's scales), as float32."""
    pointer = builder.gep(byte_base, [byte_offset])
    raw = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), _LANES).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(raw, ir.VectorType(_half, _LANES)), _V)


def _check_c_contiguous(name: str, array: types.Type) -> None:
    """numba's layout "C" guarantees a C-contiguous array; "A" (a strided view) or "F" may not be."""
    if not (isinstance(array, types.Array) and array.layout == "C"):
        raise TypingError(f"paged attention's vector IR reads {name} by pointer, so {name} must be a C-contiguous "
                          f"array; got {array} (a strided or transposed view? np.ascontiguousarray copies it)")


@intrinsic
def require_c_contiguous(typingctx, key_cache, value_cache, scratch):  # type: ignore[no-untyped-def]
    """Typing-time check, no code: the arrays whose tiles and rows `attend_group` reads by pointer
    are C-contiguous. Called first in the kernel so that this error, naming the array, is the
    one reported."""
    for name, array in (("key_cache", key_cache), ("value_cache", value_cache), ("scratch", scratch)):
        _check_c_contiguous(name, array)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return context.get_dummy_value()

    return types.void(key_cache, value_cache, scratch), codegen


def _float_scores(builder: ir.IRBuilder, rows: list[ir.Value], key_base: ir.Value, element: ir.Type, head_dim: int,
                  fma: ir.Function) -> list[ir.Value]:  # fmt: skip
    """Each head's 16 scores Σ_d q[d]·K[d, t]: four partial sums over d (d mod 4), then (s0 + s1) + (s2 + s3)."""
    partial = [[_const(0.0)] * 4 for _ in rows]
    for d in range(head_dim):
        k_d = _load_row(builder, key_base, element, ir.Constant(_i64, d * _LANES))
        for g, row in enumerate(rows):
            q_d = builder.load(builder.gep(row, [ir.Constant(_i64, d)]))
            partial[g][d % 4] = builder.call(fma, [_splat(builder, q_d), k_d, partial[g][d % 4]])
    return [builder.fadd(builder.fadd(p[0], p[1]), builder.fadd(p[2], p[3])) for p in partial]


# a quad of K rows d..d+3 holds bytes [d'][t]; vpdpbusd wants each key's four bytes together: [t][d']
_QUAD_TO_KEYS = ir.Constant(ir.VectorType(_i32, 64), [(i % 4) * _LANES + i // 4 for i in range(64)])
_UNSIGNED = ir.Constant(ir.VectorType(_i8, 64), [-128] * 64)  # xor 0x80: k + 128 as an unsigned byte


def _int8_scores(builder: ir.IRBuilder, rows: list[ir.Value], key_base: ir.Value, head_dim: int) -> list[ir.Value]:
    """Each head's 16 scores from the int8 K tile and its int8 query: per group of Q8_GROUP, the exact
    integer Σ (k + 128)·q from `vpdpbusd`s less 128·Σq, as float32, times the query's then the keys'
    scale; the groups added in order (`attention._block_scores_q8`'s arithmetic)."""
    dpbusd = dpbusd_emitter(builder, 255)
    groups = head_dim // Q8_GROUP
    q8_first = 2 * head_dim + _LANES + 2  # float slot of the int8 query in a work row
    v16i32 = ir.VectorType(_i32, _LANES)
    query_words = [builder.bitcast(builder.gep(row, [ir.Constant(_i64, q8_first)]), _i32.as_pointer()) for row in rows]
    totals: list[ir.Value | None] = [None] * len(rows)
    for group in range(groups):
        sums = [ir.Constant(v16i32, [0] * _LANES)] * len(rows)
        for quad in range(group * Q8_GROUP // 4, (group + 1) * Q8_GROUP // 4):
            pointer = builder.gep(key_base, [ir.Constant(_i64, quad * 4 * _LANES)])
            raw = builder.load(builder.bitcast(pointer, ir.VectorType(_i8, 64).as_pointer()), align=1)
            keys = builder.xor(builder.shuffle_vector(raw, raw, _QUAD_TO_KEYS), _UNSIGNED)
            for g, words in enumerate(query_words):
                word = builder.load(builder.gep(words, [ir.Constant(_i64, quad)]), align=4)
                query = builder.bitcast(builder.shuffle_vector(
                    builder.insert_element(ir.Constant(v16i32, ir.Undefined), word, ir.Constant(_i32, 0)),
                    ir.Constant(v16i32, ir.Undefined), ir.Constant(v16i32, [0] * _LANES)), ir.VectorType(_i8, 64))
                sums[g] = dpbusd(sums[g], keys, query)
        key_scales = _halves_at(builder, key_base, ir.Constant(_i64, head_dim * _LANES + 2 * _LANES * group))
        for g, row in enumerate(rows):
            q_scale = builder.load(builder.gep(row, [ir.Constant(_i64, q8_first + head_dim // 4 + group)]))
            offset = builder.load(builder.gep(row, [ir.Constant(_i64, q8_first + head_dim // 4 + groups + group)]))
            exact = builder.fsub(builder.sitofp(sums[g], _V), _splat(builder, offset))
            value = builder.fmul(builder.fmul(exact, _splat(builder, q_scale)), key_scales)
            totals[g] = value if totals[g] is None else builder.fadd(totals[g], value)
    return totals  # type: ignore[return-value]


def _open_count_loop(builder: ir.IRBuilder, count: ir.Value,
                     name: str) -> tuple[ir.Block, ir.Block, ir.Block, ir.Value]:  # fmt: skip
    """A loop over t = 0..count-1 (none when count <= 0), positioned at the top of its body: the blocks
    (entry, loop, done) and t, whose next value the caller adds as `t.add_incoming(t + 1, loop)`."""
    entry = builder.block
    loop, done = builder.append_basic_block(name), builder.append_basic_block(f"{name}_done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(_i64, 0)), loop, done)
    builder.position_at_end(loop)
    t = builder.phi(_i64)
    t.add_incoming(ir.Constant(_i64, 0), entry)
    return entry, loop, done, t


def _make_widen_q8_values(head_dim: int):  # type: ignore[no-untyped-def]
    chunks, row_width = head_dim // _LANES, head_dim + 2 * (head_dim // Q8_GROUP)

    @intrinsic
    def widen_q8_values(typingctx, values, num_keys, tile):  # type: ignore[no-untyped-def]
        """tile[t, :head_dim] = row t of an int8 V tile (16, head_dim + its fp16 group scales) as
        float32, each value times its group's scale, for t < num_keys; both C-contiguous."""
        for name, array in (("values", values), ("tile", tile)):
            _check_c_contiguous(name, array)
        if values.dtype != types.int8 or tile.dtype != types.float32:
            return None
        sig = types.void(values, num_keys, tile)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            values_value, count, tile_value = args
            source = context.make_array(signature.args[0])(context, builder, values_value).data
            target = context.make_array(signature.args[2])(context, builder, tile_value).data
            count = context.cast(builder, count, signature.args[1], types.int64)
            _, loop, done, t = _open_count_loop(builder, count, "rows")
            row = builder.gep(source, [builder.mul(t, ir.Constant(_i64, row_width))])
            out = builder.gep(target, [builder.mul(t, ir.Constant(_i64, head_dim))])
            # the row's scales as one vector load (a scalar fp16 load merges into a register, which
            # chains every chunk of the tile behind the one before)
            groups = head_dim // Q8_GROUP
            scale_bits = builder.load(builder.bitcast(builder.gep(row, [ir.Constant(_i64, head_dim)]),
                                                      ir.VectorType(ir.IntType(16), groups).as_pointer()), align=1)
            group_floats = ir.VectorType(_f32, groups)
            scales = builder.fpext(builder.bitcast(scale_bits, ir.VectorType(_half, groups)), group_floats)
            for chunk in range(chunks):
                scale = builder.shuffle_vector(scales, ir.Constant(group_floats, ir.Undefined), ir.Constant(
                    ir.VectorType(_i32, _LANES), [chunk * _LANES // Q8_GROUP] * _LANES))
                raw = builder.load(builder.bitcast(builder.gep(row, [ir.Constant(_i64, chunk * _LANES)]),
                                                   ir.VectorType(_i8, _LANES).as_pointer()), align=1)
                builder.store(builder.fmul(scale, builder.sitofp(raw, _V)), builder.bitcast(
                    builder.gep(out, [ir.Constant(_i64, chunk * _LANES)]), _V.as_pointer()), align=4)
            next_t = builder.add(t, ir.Constant(_i64, 1))
            t.add_incoming(next_t, loop)
            builder.cbranch(builder.icmp_signed("<", next_t, count), loop, done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return widen_q8_values


# an int8 V tile widened once a block for every head of its GQA group (`attention.simd_values`)
widen_q8_values_64 = _make_widen_q8_values(64)
widen_q8_values_128 = _make_widen_q8_values(128)


def _accumulate_chunks(builder: ir.IRBuilder, rows: list[ir.Value], value_base: ir.Value, value_element: ir.Type,
                       corrections: list[ir.Value], count: ir.Value, fma: ir.Function, head_dim: int,
                       chunks: range) -> None:  # fmt: skip
    """acc[chunk] = acc[chunk] · correction + Σ_{t < count} weight[t] · V[t, chunk] for each head's row
    and each of `chunks` (16 values of head_dim each), keys in order, weights from the row's block
    scratch."""
    pointers = [[builder.bitcast(builder.gep(row, [ir.Constant(_i64, head_dim + c * _LANES)]), _V.as_pointer())
                 for c in chunks] for row in rows]  # fmt: skip
    starts = [[builder.fmul(builder.load(pointer, align=4), correction) for pointer in head]
              for head, correction in zip(pointers, corrections, strict=True)]  # fmt: skip
    entry, loop, done, t = _open_count_loop(builder, count, "keys")
    phis = []
    for head in starts:
        head_phis = [builder.phi(_V) for _ in head]
        for phi, start in zip(head_phis, head, strict=True):
            phi.add_incoming(start, entry)
        phis.append(head_phis)
    row_start = builder.mul(t, ir.Constant(_i64, head_dim))
    values = [_load_row(builder, value_base, value_element, builder.add(row_start, ir.Constant(_i64, c * _LANES)))
              for c in chunks]  # fmt: skip
    updated = []
    for row, head_phis in zip(rows, phis, strict=True):
        weight = _splat(builder, builder.load(builder.gep(row, [builder.add(t, ir.Constant(_i64, 2 * head_dim))])))
        updated.append([builder.call(fma, [weight, value, phi]) for value, phi in zip(values, head_phis, strict=True)])
    next_t = builder.add(t, ir.Constant(_i64, 1))
    t.add_incoming(next_t, loop)
    for head_phis, head_updated in zip(phis, updated, strict=True):
        for phi, value in zip(head_phis, head_updated, strict=True):
            phi.add_incoming(value, loop)
    builder.cbranch(builder.icmp_signed("<", next_t, count), loop, done)
    builder.position_at_end(done)
    finals = []  # every phi first: LLVM wants them at the top of the block
    for head_starts, head_updated in zip(starts, updated, strict=True):
        for start, value in zip(head_starts, head_updated, strict=True):
            final = builder.phi(_V)
            final.add_incoming(start, entry)
            final.add_incoming(value, loop)
            finals.append(final)
    for pointer, final in zip([p for head in pointers for p in head], finals, strict=True):
        builder.store(final, pointer, align=4)


def _make_attend_group(head_dim: int, group_size: int):  # type: ignore[no-untyped-def]
    chunks = head_dim // _LANES

    @intrinsic
    def attend_group(typingctx, work, keys, values, num_keys):  # type: ignore[no-untyped-def]
        """Fold one block into the online softmax of each query head of a GQA group.

        work: (group_size, ≥ 2·head_dim + 18) float32, C-contiguous rows; row g =
        [scaled query | accumulator | 16 scratch | max, sum | int8 query] of the group's head g
        (`attention._attend_row_group`'s layout); keys: (head_dim, 16), C-contiguous, float32,
        uint16 half floats, or an int8 cache's tile with its scales (scored against the int8
        query: `attention.quantize_query_q8`); values: (16, head_dim), C-contiguous, float32 or
        uint16 (an int8 cache's tile widened by `widen_q8_values`); num_keys: the block's keys to
        use (1..16). Each K and V row is loaded (and widened) once for all the group's heads;
        each head's arithmetic is the same as if it were alone.
        """
        for name, array in (("work", work), ("keys", keys), ("values", values)):
            _check_c_contiguous(name, array)
        # int8 keys come with their block's values widened to float32 and scaled (`widen_q8_values`)
        if keys.dtype not in (types.float32, types.uint16, types.int8) or values.dtype not in (
                types.float32, types.uint16):  # fmt: skip
            return None
        sig = types.void(work, keys, values, num_keys)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            work_value, keys_value, values_value, count = args
            element = {types.uint16: _half, types.int8: _i8}.get(signature.args[1].dtype, _f32)
            quantized = element == _i8
            value_element = _half if signature.args[2].dtype == types.uint16 else _f32
            work_array = context.make_array(signature.args[0])(context, builder, work_value)
            row_floats = builder.udiv(cgutils.unpack_tuple(builder, work_array.strides)[0], ir.Constant(_i64, 4))
            rows = [builder.gep(work_array.data, [builder.mul(row_floats, ir.Constant(_i64, g))])
                    for g in range(group_size)]
            key_base = builder.bitcast(context.make_array(signature.args[1])(context, builder, keys_value).data,
                                       element.as_pointer())
            value_base = builder.bitcast(context.make_array(signature.args[2])(context, builder, values_value).data,
                                         value_element.as_pointer())
            count = context.cast(builder, count, signature.args[3], types.int64)
            fma = _intrinsic_fn(builder, "llvm.fma.v16f32", 3)

            totals = _int8_scores(builder, rows, key_base, head_dim) if quantized else \
                _float_scores(builder, rows, key_base, element, head_dim, fma)  # fmt: skip
            lane = ir.Constant(ir.VectorType(_i64, _LANES), list(range(_LANES)))
            count_splat = builder.shuffle_vector(
                builder.insert_element(ir.Constant(ir.VectorType(_i64, _LANES), ir.Undefined), count,
                                       ir.Constant(_i32, 0)),
                ir.Constant(ir.VectorType(_i64, _LANES), ir.Undefined),
                ir.Constant(ir.VectorType(_i32, _LANES), [0] * _LANES))
            valid = builder.icmp_signed("<", lane, count_splat)
            maxnum = _intrinsic_fn(builder, "llvm.maxnum.v16f32", 2)

            corrections = []
            for g, row in enumerate(rows):
                scores = builder.select(valid, totals[g], _const(float("-inf")))
                block_max = _reduce(builder, scores, lambda a, b: builder.call(maxnum, [a, b]))
                stats = builder.gep(row, [ir.Constant(_i64, 2 * head_dim + _LANES)])
                old_max = builder.load(stats)
                old_sum = builder.load(builder.gep(stats, [ir.Constant(_i64, 1)]))
                new_max = builder.select(builder.fcmp_ordered(">", block_max, old_max), block_max, old_max)
                correction = builder.extract_element(
                    _exp(builder, _splat(builder, builder.fsub(old_max, new_max))), ir.Constant(_i32, 0))
                head_weights = _exp(builder, builder.fsub(scores, _splat(builder, new_max)))
                block_sum = _reduce(builder, head_weights, builder.fadd)
                builder.store(new_max, stats)
                builder.store(builder.fadd(builder.fmul(old_sum, correction), block_sum),
                              builder.gep(stats, [ir.Constant(_i64, 1)]))
                # the weights go to the row's block scratch, from where each key's is broadcast
                builder.store(head_weights, builder.bitcast(builder.gep(row, [ir.Constant(_i64, 2 * head_dim)]),
                                                            _V.as_pointer()), align=4)
                corrections.append(_splat(builder, correction))
            # acc = acc · correction, then + Σ_{t < count} weights[t] · V[t], t in order: a pass over the
            # keys per two chunks of head_dim, every head's two accumulators in registers
            for first in range(0, chunks, 2):
                _accumulate_chunks(builder, rows, value_base, value_element, corrections, count, fma, head_dim,
                                   range(first, min(first + 2, chunks)))
            return context.get_dummy_value()

        return sig, codegen

    return attend_group


# (head_dim, heads per call) → intrinsic; `attention._attend_group_simd` cuts a GQA group into calls
attend_group_64_1 = _make_attend_group(64, 1)
attend_group_64_2 = _make_attend_group(64, 2)
attend_group_64_3 = _make_attend_group(64, 3)
attend_group_64_4 = _make_attend_group(64, 4)
attend_group_128_1 = _make_attend_group(128, 1)
attend_group_128_2 = _make_attend_group(128, 2)
attend_group_128_3 = _make_attend_group(128, 3)
attend_group_128_4 = _make_attend_group(128, 4)
