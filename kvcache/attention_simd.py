"""One block of paged attention for a GQA group's query heads, as LLVM vector IR (a numba intrinsic).

The numba kernel's loops run over a block's 16 keys, so LLVM vectorises each of them as one vector
iteration wrapped in run-time alias checks and scalar remainders, many times per block; attention
then cost ~10 ns per key and head. Here the block is explicit `<16 x float>` arithmetic: the 16
scores are one vector accumulated over head_dim, the mask, max, exp and sum act on that vector, and
the weighted sum of value rows updates head_dim / 16 accumulator vectors.

The arithmetic is the numba kernel's (`attention._block_scores` etc.) in a fixed order of its own,
which depends only on the block's keys: outputs stay independent of the batch, the thread count and
the chunking. `exp` is `fastmath.exp_f32` (Cephes, plain arithmetic) on 16 lanes; keys past
`num_keys` are masked to -inf before the max and never read from the value tile (unused slots of
a block may hold anything).

Every array is read by pointer, assuming C-contiguous tiles and rows: other layouts are refused
when the kernel is typed (`require_c_contiguous`), never misread.

Specialised for 16-key blocks and head_dim 64 or 128; other shapes use the numba path. One call
serves a whole GQA group (each K and V row is loaded and widened once for all its query heads) for
group sizes 1-4 at head_dim 64 and 1, 2, 4 at 128 (Llama-family shapes); other group sizes are
served a head at a time.
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
    """16 consecutive elements from `base` + index elements, as float32 (half floats widened, int8
    converted)."""
    pointer = builder.gep(base, [index])
    if element == _half:
        raw = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), _LANES).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(raw, ir.VectorType(_half, _LANES)), _V)
    if element == _i8:
        raw = builder.load(builder.bitcast(pointer, ir.VectorType(_i8, _LANES).as_pointer()), align=1)
        return builder.sitofp(raw, _V)
    return builder.load(builder.bitcast(pointer, _V.as_pointer()), align=4)


def _half_at(builder: ir.IRBuilder, byte_base: ir.Value, byte_offset: ir.Value, lanes: int) -> ir.Value:
    """`lanes` fp16 values at a byte offset (int8 caches' scales), as float32 (a scalar for 1 lane)."""
    pointer = builder.gep(byte_base, [byte_offset])
    if lanes == 1:
        raw = builder.load(builder.bitcast(pointer, ir.IntType(16).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(raw, _half), _f32)
    raw = builder.load(builder.bitcast(pointer, ir.VectorType(ir.IntType(16), lanes).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(raw, ir.VectorType(_half, lanes)), ir.VectorType(_f32, lanes))


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
        key_scales = _half_at(builder, key_base, ir.Constant(_i64, head_dim * _LANES + 2 * _LANES * group), _LANES)
        for g, row in enumerate(rows):
            q_scale = builder.load(builder.gep(row, [ir.Constant(_i64, q8_first + head_dim // 4 + group)]))
            offset = builder.load(builder.gep(row, [ir.Constant(_i64, q8_first + head_dim // 4 + groups + group)]))
            exact = builder.fsub(builder.sitofp(sums[g], _V), _splat(builder, offset))
            value = builder.fmul(builder.fmul(exact, _splat(builder, q_scale)), key_scales)
            totals[g] = value if totals[g] is None else builder.fadd(totals[g], value)
    return totals  # type: ignore[return-value]


def _make_attend_group(head_dim: int, group_size: int):  # type: ignore[no-untyped-def]
    chunks = head_dim // _LANES

    @intrinsic
    def attend_group(typingctx, work, keys, values, num_keys):  # type: ignore[no-untyped-def]
        """Fold one block into the online softmax of each query head of a GQA group.

        work: (group_size, ≥ 2·head_dim + 18) float32, C-contiguous rows; row g =
        [scaled query | accumulator | 16 scratch | max, sum | int8 query] of the group's head g
        (`attention._attend_row_group`'s layout); keys: (head_dim, 16) and values: (16, head_dim),
        C-contiguous, float32, uint16 half floats or int8 with their scales (an int8 cache's
        tiles, scored against the int8 query: `attention.quantize_query_q8`); num_keys: the
        block's keys to use (1..16). Each K and V row is loaded (and widened) once for all the
        group's heads; each head's arithmetic is the same as if it were alone.
        """
        for name, array in (("work", work), ("keys", keys), ("values", values)):
            _check_c_contiguous(name, array)
        if keys.dtype not in (types.float32, types.uint16, types.int8) or values.dtype != keys.dtype:
            return None
        sig = types.void(work, keys, values, num_keys)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            work_value, keys_value, values_value, count = args
            element = {types.uint16: _half, types.int8: _i8}.get(signature.args[1].dtype, _f32)
            quantized = element == _i8
            groups = head_dim // Q8_GROUP
            row_width = head_dim + 2 * groups if quantized else head_dim  # a V row, its scales included
            work_array = context.make_array(signature.args[0])(context, builder, work_value)
            row_floats = builder.udiv(cgutils.unpack_tuple(builder, work_array.strides)[0], ir.Constant(_i64, 4))
            rows = [builder.gep(work_array.data, [builder.mul(row_floats, ir.Constant(_i64, g))])
                    for g in range(group_size)]
            key_base = builder.bitcast(context.make_array(signature.args[1])(context, builder, keys_value).data,
                                       element.as_pointer())
            value_base = builder.bitcast(context.make_array(signature.args[2])(context, builder, values_value).data,
                                         element.as_pointer())
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

            weights, accs = [], []
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
                weights.append(head_weights)
                # acc = acc · correction, then + Σ_{t < count} weights[t] · V[t] below
                acc_base = builder.gep(row, [ir.Constant(_i64, head_dim)])
                correction_splat = _splat(builder, correction)
                accs.append([builder.fmul(builder.load(builder.bitcast(
                    builder.gep(acc_base, [ir.Constant(_i64, i * _LANES)]), _V.as_pointer()), align=4),
                    correction_splat) for i in range(chunks)])

            entry = builder.block
            loop = builder.append_basic_block("keys")
            done = builder.append_basic_block("keys_done")
            builder.cbranch(builder.icmp_signed(">", count, ir.Constant(_i64, 0)), loop, done)
            builder.position_at_end(loop)
            t = builder.phi(_i64)
            t.add_incoming(ir.Constant(_i64, 0), entry)
            phis = []
            for head_accs in accs:
                head_phis = []
                for acc in head_accs:
                    phi = builder.phi(_V)
                    phi.add_incoming(acc, entry)
                    head_phis.append(phi)
                phis.append(head_phis)
            row_start = builder.mul(t, ir.Constant(_i64, row_width))
            value_rows = [_load_row(builder, value_base, element, builder.add(row_start, ir.Constant(_i64, i * _LANES)))
                          for i in range(chunks)]
            # int8: the row's group scales, one per Q8_GROUP values, fold into the weight of their chunks
            row_scales = [_half_at(builder, value_base, builder.add(row_start, ir.Constant(_i64, head_dim + 2 * j)), 1)
                          for j in range(groups)] if quantized else []  # fmt: skip
            updated = []
            for g in range(group_size):
                weight = builder.extract_element(weights[g], t)
                if quantized:
                    group_weights = [_splat(builder, builder.fmul(weight, scale)) for scale in row_scales]
                    chunk_weights = [group_weights[i * _LANES // Q8_GROUP] for i in range(chunks)]
                else:
                    chunk_weights = [_splat(builder, weight)] * chunks
                updated.append([builder.call(fma, [chunk_weights[i], value_rows[i], phi])
                                for i, phi in enumerate(phis[g])])
            next_t = builder.add(t, ir.Constant(_i64, 1))
            t.add_incoming(next_t, loop)
            for head_phis, head_updated in zip(phis, updated, strict=True):
                for phi, value in zip(head_phis, head_updated, strict=True):
                    phi.add_incoming(value, loop)
            builder.cbranch(builder.icmp_signed("<", next_t, count), loop, done)
            builder.position_at_end(done)
            finals = []
            for g in range(group_size):  # phis first: LLVM wants them at the top of the block
                head_finals = []
                for i in range(chunks):
                    final = builder.phi(_V)
                    final.add_incoming(accs[g][i], entry)
                    final.add_incoming(updated[g][i], loop)
                    head_finals.append(final)
                finals.append(head_finals)
            for g, row in enumerate(rows):
                acc_base = builder.gep(row, [ir.Constant(_i64, head_dim)])
                for i, final in enumerate(finals[g]):
                    builder.store(final, builder.bitcast(builder.gep(acc_base, [ir.Constant(_i64, i * _LANES)]),
                                                         _V.as_pointer()), align=4)
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
