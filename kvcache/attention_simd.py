"""One block of paged attention for a GQA group's query heads, as LLVM vector IR (numba intrinsics).

The numba kernel's loops run over a block's 16 keys, so LLVM vectorises each of them as one vector
iteration wrapped in run-time alias checks and scalar remainders, many times per block; attention
then cost ~10 ns per key and head. Here the block is explicit `<16 x float>` arithmetic: the 16
scores are one vector accumulated over head_dim, the mask, max, exp and sum act on that vector, and
the weighted sum of value rows runs as passes over the keys, two 16-value chunks of head_dim at a
time, each head's weight for a key broadcast from its row of scratch into fused multiply-adds.

An int8 cache's scores are integer dot products (`vpdpbusd` where the CPU has VNNI): the query is
quantized per group of 32 like a key (`attention.quantize_query_q8`), the K tile stores each key's
four bytes of a quad of dimensions together, as unsigned k + 128, and the exact integer sums are
scaled by the query's and the keys' scales. Its values are summed the same way: each key's weight times its value
scale is quantized to a byte against the block's largest (`_accumulate_q8`), and `vpdpbusd` adds
the bytes times the int8 values, a quad of keys at a time, from a tile that stores each quad's four
bytes of a dimension together.

The arithmetic is the numba kernel's (`attention._block_scores` etc.) in a fixed order of its own,
which depends only on the block's keys: outputs stay independent of the batch, the thread count and
the chunking. `exp` is `fastmath.exp_f32`'s Cephes polynomial with fused multiply-adds on 16 lanes; keys past
`num_keys` are masked to -inf before the max and never read from the value tile (unused slots of
a block may hold anything).

Every array is read by pointer, assuming C-contiguous tiles and rows: other layouts are refused
when the kernel is typed (`require_c_contiguous`), never misread.

Specialised for 16-key blocks and head_dim 64, 128 or 256; other shapes use the numba path. One call
serves one to four query heads of a group from a float cache, one to eight from an int8 cache (four
with heads of 256), each K and V row loaded once for all of them; `attention._heads_in_next_call`
cuts larger groups. From an int8 cache a call folds one block or two (the paged kernel passes pairs
by position), with heads of 256 one.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from kvcache.fastmath import EXP_MIN, EXP_POLYNOMIAL, LN2_HI, LN2_LO, LOG2E
from kvcache.int8_dot import dpbusd_emitter
from kvcache.prefetch import CACHE_LINE_BYTES, emit_pinned_prefetch

SIMD_BLOCK_SIZE = 16
MAX_FLOAT_HEADS = 4  # query heads a call serves from a float cache (their accumulators fill the registers)
MAX_INT8_HEADS = 8  # and from an int8 cache, with heads of 64 or 128
# Heads of 256 (Gemma 2 and 3's): from an int8 cache a call serves at most 4 of them (Gemma's groups
# are 2 or 4; 8 would compile the int8 kernel ~14 s longer) and folds one block, never a pair (two
# blocks' value bytes against one largest weight and scale cost Gemma 3 0.45 points of top-1
# agreement with float16)
WIDE_HEAD_DIM = 256
MAX_WIDE_INT8_HEADS = 4
_LANES = SIMD_BLOCK_SIZE
_f32, _i8, _i32, _i64, _half = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.HalfType()
Q8_GROUP = 32  # kvcache.storage.Q8_GROUP: int8 values per fp16 scale
# a block whose largest weight times value scale is below this adds nothing to an int8 cache's sum
# (its weights are < 1e-30 of the running max's): 255 / it stays finite
Q8_WEIGHT_FLOOR = 1e-30
Q8_BACK = 1 / 255  # (as float32) takes an int8 cache's byte weights back to weights


@njit(nogil=True, cache=True, inline="always")
def q8_dither(key: int, group: int) -> float:
    """What an int8 cache's byte weight of `key` (its slot in the block) in value group `group` adds
    before it is cut to an integer: (k + 0.5) / 16 for a k that runs over 0..15 along a block's keys
    (a different order for each group). Rounding every weight to nearest would drop each one below
    half a step, and a long context's many small weights with it; cut after a spread of offsets
    they count as much as they weigh, on average."""
    return ((key * 7 + group * 5) % 16 + 0.5) / 16
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
    """e**x on 16 lanes for x ≤ 0 (a score less the running max, or an old max less a new one):
    exp_f32's range reduction and polynomial (Cephes expf) with fused multiply-adds, so within an
    ulp of it, not always the same bits; exactly 0 below -87, so exp(-inf) = 0."""
    fma = _intrinsic_fn(builder, "llvm.fma.v16f32", 3)
    floor = _intrinsic_fn(builder, "llvm.floor.v16f32", 1)
    clamped = _max(builder, x, _const(EXP_MIN))
    n = builder.call(floor, [builder.call(fma, [clamped, _const(LOG2E), _const(0.5)])])
    r = builder.call(fma, [n, _const(-LN2_LO), builder.call(fma, [n, _const(-LN2_HI), clamped])])
    p = _const(EXP_POLYNOMIAL[0])
    for coefficient in EXP_POLYNOMIAL[1:]:
        p = builder.call(fma, [p, r, _const(coefficient)])
    p = builder.fadd(builder.call(fma, [builder.fmul(p, r), r, r]), _const(1.0))
    exponent = builder.shl(builder.add(builder.fptosi(n, ir.VectorType(_i32, _LANES)),
                                       ir.Constant(ir.VectorType(_i32, _LANES), [127] * _LANES)),
                           ir.Constant(ir.VectorType(_i32, _LANES), [23] * _LANES))
    scaled = builder.fmul(p, builder.bitcast(exponent, _V))
    in_range = builder.fcmp_ordered(">=", x, _const(EXP_MIN))
    return builder.select(in_range, scaled, _const(0.0))


def _max(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """The larger of a and b, lane by lane, as one `vmaxps` (`llvm.maxnum` adds NaN checks; nothing
    here is NaN: masked lanes are -inf or 0)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _reduce(builder: ir.IRBuilder, vectors: list[ir.Value], combine) -> ir.Value:  # type: ignore[no-untyped-def]
    """One lane from a call's per-block vectors: combined lane by lane, then halved until one lane is
    left by a fixed tree (lane i with lane i + width / 2)."""
    vector = vectors[0]
    for other in vectors[1:]:
        vector = combine(vector, other)
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


def _require_c_contiguous(named: tuple[tuple[str, types.Type], ...]) -> None:
    """Refuse, naming every one that is not, arrays the vector IR reads by pointer: numba's layout "C"
    guarantees a C-contiguous array; "A" (a strided view) or "F" may not be."""
    refused = [f"{name} ({array})" for name, array in named
               if not (isinstance(array, types.Array) and array.layout == "C")]  # fmt: skip
    if refused:
        raise TypingError(f"paged attention's vector IR reads {', '.join(name for name, _ in named)} by pointer, "
                          f"so each must be a C-contiguous array; not so: {', '.join(refused)} (a strided or "
                          f"transposed view? np.ascontiguousarray copies it)")


@intrinsic
def require_c_contiguous(typingctx, key_cache, value_cache, scratch):  # type: ignore[no-untyped-def]
    """Typing-time check, no code: the arrays whose tiles and rows `attend_heads` reads by pointer
    are C-contiguous. Called first in the kernel so that this error, naming every array that is
    not, is the one reported."""
    _require_c_contiguous((("key_cache", key_cache), ("value_cache", value_cache), ("scratch", scratch)))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return context.get_dummy_value()

    return types.void(key_cache, value_cache, scratch), codegen


def is_tiled_cache(array: types.Type) -> bool:
    """A KV cache layer as the kernels read it: (KV heads, blocks, rows, columns), C-contiguous."""
    return isinstance(array, types.Array) and array.ndim == 4 and array.layout == "C"


def tile_pointer(context, builder, array_type, array_value, block_id, kv_head) -> ir.Value:  # type: ignore[no-untyped-def]
    """The first byte (as i8*) of tile (kv_head, block_id), int64 IR values, of a C-contiguous 4-D cache."""
    array = context.make_array(array_type)(context, builder, array_value)
    strides = cgutils.unpack_tuple(builder, array.strides)
    offset = builder.add(builder.mul(kv_head, strides[0]), builder.mul(block_id, strides[1]))
    return builder.gep(builder.bitcast(array.data, _i8.as_pointer()), [offset])


def int8_tile_lines(head_dim: int) -> int:
    """Cache lines of one int8 K or V tile: 16 keys' head_dim bytes, then each group's 16 fp16 scales."""
    return -(-(SIMD_BLOCK_SIZE * head_dim + 2 * SIMD_BLOCK_SIZE * (head_dim // Q8_GROUP)) // CACHE_LINE_BYTES)


def _prefetcher(builder: ir.IRBuilder, tile: ir.Value, lines: int):  # type: ignore[no-untyped-def]
    """A function that asks for line i (< lines) of the tile at `tile` (i8*) into L2 (`prefetcht1`):
    called once per step of a kernel loop, the requests are spread through the block's arithmetic."""
    def ask(line: int) -> None:
        if line < lines:
            emit_pinned_prefetch(builder, builder.gep(tile, [ir.Constant(_i64, line * CACHE_LINE_BYTES)]))

    return ask


def _float_scores(builder: ir.IRBuilder, rows: list[ir.Value], key_base: ir.Value, element: ir.Type, head_dim: int,
                  fma: ir.Function, key_ahead: ir.Value) -> list[ir.Value]:  # fmt: skip
    """Each head's 16 scores Σ_d q[d]·K[d, t]: four partial sums over d (d mod 4), then (s0 + s1) + (s2 + s3).
    Each line of the K tile at `key_ahead` is asked for beside the row of keys at its offset."""
    partial = [[_const(0.0)] * 4 for _ in rows]
    row_bytes = _LANES * (2 if element == _half else 4)
    for d in range(head_dim):
        if d * row_bytes % CACHE_LINE_BYTES == 0:
            emit_pinned_prefetch(builder, builder.gep(key_ahead, [ir.Constant(_i64, d * row_bytes)]))
        k_d = _load_row(builder, key_base, element, ir.Constant(_i64, d * _LANES))
        for g, row in enumerate(rows):
            q_d = builder.load(builder.gep(row, [ir.Constant(_i64, d)]))
            partial[g][d % 4] = builder.call(fma, [_splat(builder, q_d), k_d, partial[g][d % 4]])
    return [builder.fadd(builder.fadd(p[0], p[1]), builder.fadd(p[2], p[3])) for p in partial]




def _int8_scores(builder: ir.IRBuilder, rows: list[ir.Value], key_bases: list[ir.Value], head_dim: int,
                 key_aheads: list[ir.Value]) -> list[list[ir.Value]]:  # fmt: skip
    """Each block's 16 scores for each head ([block][head]) from the int8 K tiles and the heads'
    int8 queries: per group of Q8_GROUP, the exact integer Σ (k + 128)·q from `vpdpbusd`s less
    128·Σq, as float32, times the query's then the keys' scale; the groups added in order
    (`attention._block_scores_q8`'s arithmetic, with fused multiply-adds). The blocks are scored
    side by side, each quad of a query broadcast once for all of them. A line of each K tile at
    `key_aheads` is asked for with each quad of dimensions."""
    dpbusd = dpbusd_emitter(builder, 255)
    fma = _intrinsic_fn(builder, "llvm.fma.v16f32", 3)
    groups = head_dim // Q8_GROUP
    lines = int8_tile_lines(head_dim)
    asks = [_prefetcher(builder, ahead, lines) for ahead in key_aheads]
    q8_first = 2 * head_dim + _LANES + 2  # float slot of the int8 query in a work row
    v16i32 = ir.VectorType(_i32, _LANES)
    query_words = [builder.bitcast(builder.gep(row, [ir.Constant(_i64, q8_first)]), _i32.as_pointer()) for row in rows]
    totals: list[list[ir.Value | None]] = [[None] * len(rows) for _ in key_bases]
    for group in range(groups):
        sums = [[ir.Constant(v16i32, [0] * _LANES)] * len(rows) for _ in key_bases]
        for quad in range(group * Q8_GROUP // 4, (group + 1) * Q8_GROUP // 4):
            keys = []
            for key_base, ask in zip(key_bases, asks, strict=True):
                ask(quad)
                # the tile stores each key's four bytes of the quad together, as k + 128 (`attention._store_q8_key`)
                pointer = builder.gep(key_base, [ir.Constant(_i64, quad * 4 * _LANES)])
                keys.append(builder.load(builder.bitcast(pointer, ir.VectorType(_i8, 64).as_pointer()), align=1))
            for g, words in enumerate(query_words):
                word = builder.load(builder.gep(words, [ir.Constant(_i64, quad)]), align=4)
                query = builder.bitcast(builder.shuffle_vector(
                    builder.insert_element(ir.Constant(v16i32, ir.Undefined), word, ir.Constant(_i32, 0)),
                    ir.Constant(v16i32, ir.Undefined), ir.Constant(v16i32, [0] * _LANES)), ir.VectorType(_i8, 64))
                for block_sums, block_keys in zip(sums, keys, strict=True):
                    block_sums[g] = dpbusd(block_sums[g], block_keys, query)
        for key_base, block_sums, block_totals in zip(key_bases, sums, totals, strict=True):
            key_scales = _halves_at(builder, key_base, ir.Constant(_i64, head_dim * _LANES + 2 * _LANES * group))
            for g, row in enumerate(rows):
                q_scale = builder.load(builder.gep(row, [ir.Constant(_i64, q8_first + head_dim // 4 + group)]))
                scaled_offset = builder.load(builder.gep(row, [ir.Constant(
                    _i64, q8_first + head_dim // 4 + groups + group)]))  # fmt: skip
                # (Σ - 128·Σq) · query scale as one fused multiply-add: Σ · scale + (-(128·Σq) · scale)
                query_scaled = builder.call(fma, [builder.sitofp(block_sums[g], _V), _splat(builder, q_scale),
                                                  _splat(builder, scaled_offset)])  # fmt: skip
                block_totals[g] = builder.fmul(query_scaled, key_scales) if block_totals[g] is None else \
                    builder.call(fma, [query_scaled, key_scales, block_totals[g]])  # fmt: skip
    for ask in asks:
        for line in range(head_dim // 4, lines):  # the scales' lines
            ask(line)
    return totals  # type: ignore[return-value]


def _open_count_loop(builder: ir.IRBuilder, start: ir.Value, count: ir.Value,
                     name: str) -> tuple[ir.Block, ir.Block, ir.Block, ir.Value]:  # fmt: skip
    """A loop over t = start..count-1 (none when count <= start), positioned at the top of its body: the
    blocks (entry, loop, done) and t, whose next value the caller adds as `t.add_incoming(t + 1, loop)`."""
    entry = builder.block
    loop, done = builder.append_basic_block(name), builder.append_basic_block(f"{name}_done")
    builder.cbranch(builder.icmp_signed(">", count, start), loop, done)
    builder.position_at_end(loop)
    t = builder.phi(_i64)
    t.add_incoming(start, entry)
    return entry, loop, done, t


def _accumulate_q8(builder: ir.IRBuilder, rows: list[ir.Value], value_bases: list[ir.Value],
                   weights: list[list[ir.Value]], valids: list[ir.Value], fma: ir.Function, head_dim: int,
                   value_aheads: list[ir.Value]) -> None:  # fmt: skip
    """acc += the call's weighted sum of its int8 V tiles (one or two blocks), as integer dot products.

    Per group of Q8_GROUP dimensions each key's weight and value scale become one byte against the
    call's largest of each (W = max w, S = max s over its keys):
    a[t] = min(trunc(w[t] · (255 / W) · (s[t] · (1 / S)) + q8_dither(t, group)), 255) (the last product and
    the sum fused); `vpdpbusd` sums a[t] · v[t, d]
    exactly over each quad of keys (a tile stores a quad's four bytes of one dimension together,
    `storage`), and the sum over the call's keys returns as float32 times W · S · (1 / 255)
    (`attention._accumulate_values_q8`'s arithmetic, for one block). Keys at or past a block's count
    have weight 0 and their scales are masked to 0 (unused slots may hold NaN bits), so their bytes
    add nothing. A line of tile i's `value_aheads[i]` is asked for with each of its quads of keys."""
    dpbusd = dpbusd_emitter(builder, 255)
    groups = head_dim // Q8_GROUP
    tiles = range(len(value_bases))
    v16i32, v16i8 = ir.VectorType(_i32, _LANES), ir.VectorType(_i8, _LANES)
    umin = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i32, [v16i32, v16i32]), "llvm.umin.v16i32")
    zero, one = ir.Constant(_f32, 0.0), ir.Constant(_f32, 1.0)
    scales, top_scales = [], []  # scales[group][tile]
    for group in range(groups):
        group_scales = [builder.select(valids[i], _halves_at(builder, value_bases[i], ir.Constant(
            _i64, _LANES * head_dim + 2 * _LANES * group)), _const(0.0)) for i in tiles]  # fmt: skip
        top_scale = _reduce(builder, group_scales, lambda a, b: _max(builder, a, b))
        inverse = builder.select(builder.fcmp_ordered(">", top_scale, zero), builder.fdiv(one, top_scale), zero)
        scales.append([builder.fmul(scale, _splat(builder, inverse)) for scale in group_scales])
        top_scales.append(top_scale)
    # each step for every head before the next (their chains interleave), each quad of values loaded once
    byte_bases, back_scales = [], []  # byte_bases[head][tile]
    for row, head_weights in zip(rows, weights, strict=True):
        top_weight = _reduce(builder, head_weights, lambda a, b: _max(builder, a, b))
        usable = builder.fcmp_ordered(">", top_weight, ir.Constant(_f32, Q8_WEIGHT_FLOOR))
        to_bytes = builder.select(usable, builder.fdiv(ir.Constant(_f32, 255.0), top_weight), zero)
        byte_bases.append([builder.bitcast(builder.gep(row, [ir.Constant(_i64, offset)]), _i8.as_pointer())
                           for offset in _byte_weight_slots(head_dim)[: len(tiles)]])  # fmt: skip
        for i in tiles:
            byte_weights = builder.fmul(head_weights[i], _splat(builder, to_bytes))
            for group, group_scales in enumerate(scales):
                dither = ir.Constant(_V, [q8_dither(key, group) for key in range(_LANES)])
                cut = builder.fptosi(builder.call(fma, [byte_weights, group_scales[i], dither]), v16i32)
                # the group's bytes in the row's scratch (16 floats = 64 bytes a block), broadcast by
                # quads below; min then truncation is one saturating `vpmovusdb`
                builder.store(builder.trunc(builder.call(umin, [cut, ir.Constant(v16i32, [255] * _LANES)]), v16i8),
                              builder.bitcast(builder.gep(byte_bases[-1][i], [ir.Constant(_i64, group * _LANES)]),
                                              v16i8.as_pointer()), align=1)  # fmt: skip
        back_scales.append([_splat(builder, builder.fmul(builder.fmul(top_weight, top_scale),
                                                         ir.Constant(_f32, Q8_BACK))) for top_scale in top_scales])
    words = [[builder.bitcast(base, _i32.as_pointer()) for base in head_bases] for head_bases in byte_bases]
    lines = int8_tile_lines(head_dim)
    asks = [_prefetcher(builder, ahead, lines) for ahead in value_aheads]
    for chunk in range(head_dim // _LANES):
        group = chunk * _LANES // Q8_GROUP
        dots = [ir.Constant(v16i32, [0] * _LANES)] * len(rows)
        for i in tiles:
            for quad in range(_LANES // 4):
                asks[i](chunk * _LANES // 4 + quad)
                pointer = builder.gep(value_bases[i], [ir.Constant(_i64, quad * 4 * head_dim + chunk * 4 * _LANES)])
                quad_values = builder.load(builder.bitcast(pointer, ir.VectorType(_i8, 64).as_pointer()), align=1)
                for h, head_words in enumerate(words):
                    word = builder.load(builder.gep(head_words[i], [ir.Constant(_i64, group * _LANES // 4 + quad)]),
                                        align=4)  # fmt: skip
                    quad_weights = builder.bitcast(builder.shuffle_vector(
                        builder.insert_element(ir.Constant(v16i32, ir.Undefined), word, ir.Constant(_i32, 0)),
                        ir.Constant(v16i32, ir.Undefined), ir.Constant(v16i32, [0] * _LANES)), ir.VectorType(_i8, 64))
                    dots[h] = dpbusd(dots[h], quad_weights, quad_values)
        for row, dot, head_back_scales in zip(rows, dots, back_scales, strict=True):
            acc_pointer = builder.bitcast(builder.gep(row, [ir.Constant(_i64, head_dim + chunk * _LANES)]),
                                          _V.as_pointer())
            builder.store(builder.call(fma, [builder.sitofp(dot, _V), head_back_scales[group],
                                             builder.load(acc_pointer, align=4)]), acc_pointer, align=4)
    for ask in asks:
        for line in range(head_dim // 4, lines):  # the scales' lines
            ask(line)


def byte_weight_floats(head_dim: int) -> int:
    """float32 slots of a work row that one block's byte weights take: 16 bytes for each group of Q8_GROUP
    dimensions (a byte per key)."""
    return head_dim // Q8_GROUP * _LANES // 4


def _byte_weight_slots(head_dim: int) -> tuple[int, int]:
    """Float offsets in a work row of a call's first and second block's byte weights: after the int8
    query, where the numba path keeps its byte weights (`attention.attention_scratch`'s layout)."""
    first = 2 * head_dim + _LANES + 2 + head_dim // 4 + 2 * (head_dim // Q8_GROUP)
    return first, first + max(_LANES, byte_weight_floats(head_dim))


def _accumulate_chunks(builder: ir.IRBuilder, rows: list[ir.Value], value_base: ir.Value, value_element: ir.Type,
                       first_key: ir.Value, count: ir.Value, fma: ir.Function, head_dim: int, chunks: range,
                       value_ahead: ir.Value) -> None:  # fmt: skip
    """acc[chunk] += Σ_{first_key <= t < count} weight[t] · V[t, chunk] for each head's row
    and each of `chunks` (16 values of head_dim each), keys in order, weights from the row's block
    scratch. Key t's step asks for the lines of the V tile at `value_ahead` that hold its `chunks`
    (so the passes over a block's keys ask for the whole tile)."""
    pointers = [[builder.bitcast(builder.gep(row, [ir.Constant(_i64, head_dim + c * _LANES)]), _V.as_pointer())
                 for c in chunks] for row in rows]  # fmt: skip
    starts = [[builder.load(pointer, align=4) for pointer in head] for head in pointers]
    entry, loop, done, t = _open_count_loop(builder, first_key, count, "keys")
    phis = []
    for head in starts:
        head_phis = [builder.phi(_V) for _ in head]
        for phi, start in zip(head_phis, head, strict=True):
            phi.add_incoming(start, entry)
        phis.append(head_phis)
    row_start = builder.mul(t, ir.Constant(_i64, head_dim))
    element_bytes = 2 if value_element == _half else 4
    first_byte = builder.mul(builder.add(row_start, ir.Constant(_i64, chunks[0] * _LANES)),
                             ir.Constant(_i64, element_bytes))  # fmt: skip
    for offset in range(0, len(chunks) * _LANES * element_bytes, CACHE_LINE_BYTES):
        emit_pinned_prefetch(builder, builder.gep(value_ahead, [builder.add(first_byte, ir.Constant(_i64, offset))]))
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


def _never_called(context, builder, signature, args):  # type: ignore[no-untyped-def]
    """A call that must not run: a trap, so that one kernel body with run-time branches can name
    every call for every cache type (typing an overload that chose per type compiled it in full)."""
    builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.trap"), [])
    return context.get_dummy_value()


def _block_arguments(context, builder, signature, args) -> tuple[list, list, list]:  # type: ignore[no-untyped-def]
    """attend_heads' (block ids, key counts, blocks to prefetch) as lists of int64 IR values, one
    entry per block of the call."""
    lists = []
    for index in (6, 8, 9):
        kind, value = signature.args[index], args[index]
        if isinstance(kind, types.BaseTuple):
            lists.append([context.cast(builder, builder.extract_value(value, i), kind[i], types.int64)
                          for i in range(len(kind))])  # fmt: skip
        else:
            lists.append([context.cast(builder, value, kind, types.int64)])
    return lists[0], lists[1], lists[2]


def _emit_attend_group(context, builder, signature, args, head_dim: int, group_size: int) -> None:  # type: ignore[no-untyped-def]
    """`attend_heads`'s code for one head_dim and one number of heads (`group_size`)."""
    chunks = head_dim // _LANES
    work_value, keys_value, values_value = args[0], args[4], args[5]
    first, head, first_key = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 7, 10))
    blocks, counts, aheads = _block_arguments(context, builder, signature, args)
    element = {types.uint16: _half, types.int8: _i8}.get(signature.args[4].dtype, _f32)
    quantized = element == _i8
    # a float cache, and an int8 one with heads of 256, fold one block a call: the second is empty
    if (not quantized or head_dim == WIDE_HEAD_DIM) and len(blocks) == 2:
        with builder.if_then(builder.icmp_signed("!=", counts[1], ir.Constant(_i64, 0)), likely=False):
            _never_called(context, builder, signature, args)
        blocks, counts, aheads = blocks[:1], counts[:1], aheads[:1]
    value_element = {types.uint16: _half, types.int8: _i8}.get(signature.args[5].dtype, _f32)
    work_array = context.make_array(signature.args[0])(context, builder, work_value)
    row_floats = builder.udiv(cgutils.unpack_tuple(builder, work_array.strides)[0], ir.Constant(_i64, 4))
    rows = [builder.gep(work_array.data, [builder.mul(row_floats, builder.add(first, ir.Constant(_i64, g)))])
            for g in range(group_size)]  # fmt: skip
    key_bases = [builder.bitcast(tile_pointer(context, builder, signature.args[4], keys_value, block, head),
                                 element.as_pointer()) for block in blocks]  # fmt: skip
    value_bases = [builder.bitcast(tile_pointer(context, builder, signature.args[5], values_value, block, head),
                                   value_element.as_pointer()) for block in blocks]  # fmt: skip
    fma = _intrinsic_fn(builder, "llvm.fma.v16f32", 3)

    # later blocks' tiles are asked for from the kernel's loops; with none to ask for (ahead < 0)
    # the block's own, in cache already
    aheads = [builder.select(builder.icmp_signed(">=", ahead, ir.Constant(_i64, 0)), ahead, block)
              for ahead, block in zip(aheads, blocks, strict=True)]  # fmt: skip
    value_aheads = [tile_pointer(context, builder, signature.args[5], values_value, ahead, head) for ahead in aheads]
    key_aheads = [tile_pointer(context, builder, signature.args[4], keys_value, ahead, head) for ahead in aheads]
    if quantized:
        totals = _int8_scores(builder, rows, key_bases, head_dim, key_aheads)
    else:
        totals = [_float_scores(builder, rows, key_bases[0], element, head_dim, fma, key_aheads[0])]
    lane = ir.Constant(ir.VectorType(_i64, _LANES), list(range(_LANES)))
    def lanes_of(value: ir.Value) -> ir.Value:
        return builder.shuffle_vector(
            builder.insert_element(ir.Constant(ir.VectorType(_i64, _LANES), ir.Undefined), value,
                                   ir.Constant(_i32, 0)),
            ir.Constant(ir.VectorType(_i64, _LANES), ir.Undefined),
            ir.Constant(ir.VectorType(_i32, _LANES), [0] * _LANES))

    valids = [builder.icmp_signed("<", lane, lanes_of(count)) for count in counts]
    # the first block's keys before first_key are outside the row's window: never weighted
    valids[0] = builder.and_(valids[0], builder.icmp_signed(">=", lane, lanes_of(first_key)))

    # each step for every head before the next, in one basic block: the heads' chains
    # (max, exp, sum) interleave instead of running one after another. scores[head][block]
    stats = [builder.gep(row, [ir.Constant(_i64, 2 * head_dim + _LANES)]) for row in rows]
    scores = [[builder.select(valid, block_totals[g], _const(float("-inf")))
               for valid, block_totals in zip(valids, totals, strict=True)] for g in range(group_size)]  # fmt: skip
    old_maxes = [builder.load(head_stats) for head_stats in stats]
    # a head's max rises where one of its scores is above the running max: one compare a head, and
    # the call's max (a reduction across lanes) only then. exp(old max - new max) is exp(0) = 1
    # exactly for a head whose max holds: while no head's max rises (most blocks of a long context)
    # the maxes, the exps and the accumulators' rescale are skipped
    i16 = ir.IntType(_LANES)
    any_rises = None
    for head_scores, old_max in zip(scores, old_maxes, strict=True):
        for block_scores in head_scores:
            above = builder.bitcast(builder.fcmp_ordered(">", block_scores, _splat(builder, old_max)), i16)
            any_rises = above if any_rises is None else builder.or_(any_rises, above)
    any_rises = builder.icmp_unsigned("!=", any_rises, ir.Constant(i16, 0))
    kept = builder.block
    with builder.if_then(any_rises):
        risen_maxes, shrinks = [], []
        for row, head_scores, old_max in zip(rows, scores, old_maxes, strict=True):
            call_max = _reduce(builder, head_scores, lambda a, b: _max(builder, a, b))
            new_max = builder.select(builder.fcmp_ordered(">", call_max, old_max), call_max, old_max)
            risen_maxes.append(new_max)
            shrinks.append(builder.extract_element(
                _exp(builder, _splat(builder, builder.fsub(old_max, new_max))), ir.Constant(_i32, 0)))
            for chunk in range(chunks):
                acc_pointer = builder.bitcast(builder.gep(row, [ir.Constant(_i64, head_dim + chunk * _LANES)]),
                                              _V.as_pointer())  # fmt: skip
                builder.store(builder.fmul(builder.load(acc_pointer, align=4), _splat(builder, shrinks[-1])),
                              acc_pointer, align=4)  # fmt: skip
        shrunk = builder.block
    corrections, new_maxes = [], []  # every phi first: LLVM wants them at the top of the block
    for shrink, old_max, risen_max in zip(shrinks, old_maxes, risen_maxes, strict=True):
        corrections.append(builder.phi(_f32))
        corrections[-1].add_incoming(ir.Constant(_f32, 1.0), kept)
        corrections[-1].add_incoming(shrink, shrunk)
        new_maxes.append(builder.phi(_f32))
        new_maxes[-1].add_incoming(old_max, kept)
        new_maxes[-1].add_incoming(risen_max, shrunk)
    weights = [[_exp(builder, builder.fsub(block_scores, _splat(builder, new_max))) for block_scores in head_scores]
               for head_scores, new_max in zip(scores, new_maxes, strict=True)]  # fmt: skip
    call_sums = [_reduce(builder, head_weights, builder.fadd) for head_weights in weights]
    for head_stats, new_max, correction, call_sum in zip(stats, new_maxes, corrections, call_sums,
                                                         strict=True):  # fmt: skip
        old_sum = builder.load(builder.gep(head_stats, [ir.Constant(_i64, 1)]))
        builder.store(new_max, head_stats)
        builder.store(builder.fadd(builder.fmul(old_sum, correction), call_sum),
                      builder.gep(head_stats, [ir.Constant(_i64, 1)]))
    if quantized:
        _accumulate_q8(builder, rows, value_bases, weights, valids, fma, head_dim, value_aheads)
        return
    for row, head_weights in zip(rows, weights, strict=True):
        # the weights go to the row's block scratch, from where each key's is broadcast
        builder.store(head_weights[0], builder.bitcast(builder.gep(row, [ir.Constant(_i64, 2 * head_dim)]),
                                                       _V.as_pointer()), align=4)
    # acc += Σ_{t < count} weights[t] · V[t], t in order: a pass over the keys per two chunks of
    # head_dim, every head's two accumulators in registers
    for first in range(0, chunks, 2):
        _accumulate_chunks(builder, rows, value_bases[0], value_element, first_key, counts[0], fma, head_dim,
                           range(first, min(first + 2, chunks)), value_aheads[0])


# the (head_dim, heads a call) the vector IR is written for; a float cache's calls serve at most
# MAX_FLOAT_HEADS (more accumulators would spill)
SHAPES = tuple((head_dim, heads) for head_dim in (64, 128, WIDE_HEAD_DIM)
               for heads in range(1, (MAX_WIDE_INT8_HEADS if head_dim == WIDE_HEAD_DIM else MAX_INT8_HEADS) + 1))


def _blocks_named(argument: types.Type) -> int | None:
    """How many blocks an attend_heads argument names: 1 for an integer, 2 for a pair of them."""
    if isinstance(argument, types.Integer):
        return 1
    if isinstance(argument, types.BaseTuple) and len(argument) == 2 and all(
            isinstance(item, types.Integer) for item in argument):  # fmt: skip
        return 2
    return None


@intrinsic(prefer_literal=True)
def attend_heads(typingctx, work, first_head, heads, head_dim, key_cache, value_cache, block_id, kv_head, num_keys,
                 prefetch_block, first_key):  # type: ignore[no-untyped-def]  # fmt: skip
    """Fold one block, or two from an int8 cache, into the online softmax of `heads` query heads of
    a GQA group (of one query row, or of several rows of a sequence that read the block whole).

    work: (≥ first_head + heads, ≥ 2·head_dim + 18; from an int8 cache `attention.attention_scratch`'s
    width) float32, C-contiguous rows; row first_head + g = [scaled query | accumulator | 16 scratch
    | max, sum | int8 query | two blocks' byte weights] of the call's head g (`attention._attend_row_group`'s
    layout); key_cache: (KV heads, blocks,
    head_dim, 16), C-contiguous, float32, uint16 half floats, or an int8 cache's tiles with their
    scales (scored against the int8 query: `attention.quantize_query_q8`); value_cache: (KV heads,
    blocks, 16, head_dim), C-contiguous, of the keys' type (an int8 tile in its quad layout,
    `kvcache.storage`); the tiles read are (kv_head, block_id); num_keys: the block's keys to use
    (0..16; at least one in the call), of which the first block's before `first_key` are outside the
    row's window (never weighted; 0 where the block is read whole). Each K and V row is loaded (and
    widened) once for all the call's heads; each head's arithmetic is the same as if it were alone.
    The call also asks for the tiles of block `prefetch_block` (none where it is negative) into L2,
    a line with each step of its loops (`prefetch.emit_pinned_prefetch`): a block's requests (68
    from an int8 cache, 128-256 from a float one) spread through its arithmetic, not in a burst its
    own loads wait behind.

    block_id, num_keys and prefetch_block may each be a pair. From an int8 cache the call then folds
    two blocks' 32 keys as one softmax step, their value bytes against one largest weight and scale
    and their integer sums added before they return to float, so the softmax's reductions, the
    accumulators' loads and stores and the call's set-up are paid once for two blocks (either may be
    empty: the other's arithmetic is then the same as alone). A different pairing of the same blocks
    rounds differently: callers pair blocks by position only. A float cache, and an int8 one with
    heads of WIDE_HEAD_DIM, fold the first block of a pair, whose second must be empty (it traps
    otherwise), so that one call site serves every cache type.

    (head_dim, heads) must be one of `SHAPES` (1..4 heads from a float cache): with constants,
    that one call's code is compiled; with values known only at run time, a switch over every
    shape that has the constant one, if any (another traps). The caches are read by pointer, never
    through a view (a view's reference counting is an atomic operation per block).
    """
    _require_c_contiguous((("work", work), ("key_cache", key_cache), ("value_cache", value_cache)))
    indices = (first_head, heads, head_dim, kv_head, first_key)
    per_block = (block_id, num_keys, prefetch_block)
    if not (is_tiled_cache(key_cache) and is_tiled_cache(value_cache)
            and all(isinstance(index, types.Integer) for index in indices)):  # fmt: skip
        return None
    blocks = {_blocks_named(argument) for argument in per_block}
    if len(blocks) != 1 or None in blocks:
        return None
    stored = (types.float32, types.uint16, types.int8)
    if key_cache.dtype not in stored or value_cache.dtype not in stored or (
            (value_cache.dtype == types.int8) != (key_cache.dtype == types.int8)):  # fmt: skip
        return None
    most_heads = MAX_INT8_HEADS if key_cache.dtype == types.int8 else MAX_FLOAT_HEADS
    shapes = [(d, h) for d, h in SHAPES if h <= most_heads]
    # a constant head_dim or head count leaves only the shapes that have it
    fixed = [getattr(index, "literal_value", None) for index in (head_dim, heads)]
    shapes = [shape for shape in shapes if all(f is None or f == v for f, v in zip(fixed, shape, strict=True))]
    if not shapes:
        raise TypingError(f"attend_heads has no code for head_dim {fixed[0]} with {fixed[1]} heads a call "
                          f"from a {key_cache.dtype} cache")
    sig = types.void(work, first_head, heads, head_dim, key_cache, value_cache, block_id, kv_head, num_keys,
                     prefetch_block, first_key)  # fmt: skip

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if len(shapes) == 1:
            _emit_attend_group(context, builder, signature, args, *shapes[0])
            return context.get_dummy_value()
        dim = context.cast(builder, args[3], signature.args[3], types.int64)
        count = context.cast(builder, args[2], signature.args[2], types.int64)
        shape_key = builder.add(builder.mul(dim, ir.Constant(_i64, 16)), count)
        done = builder.append_basic_block("attend_done")
        unknown = builder.append_basic_block("attend_unknown")
        switch = builder.switch(shape_key, unknown)
        for d, h in shapes:
            case = builder.append_basic_block(f"attend_{d}_{h}")
            switch.add_case(ir.Constant(_i64, d * 16 + h), case)
            builder.position_at_end(case)
            _emit_attend_group(context, builder, signature, args, d, h)
            builder.branch(done)
        builder.position_at_end(unknown)
        _never_called(context, builder, signature, args)
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen
