"""AMX int8 tiles for the `fast` kernels: 16 weight rows (two 8-row groups) against token tiles of 16, bit for
bit the VNNI kernel's numbers (decoding.kernels.vnni).

The VNNI kernel keeps, per row and 32-weight block, one int32 sum (the two lanes of the row's halves added in
integers), scales it in float32 and adds it to the row's accumulator. A token's numbers must not depend on the
batch it runs in, so the tile kernel forms those same integers and repeats the same float operations. Per block
one `TDPBUSD` multiplies A, 16 rows × 32 bytes (row i is weight row i of the two groups, its 32 bytes in the K
order), by B, 8 rows × 16 tokens' activation bytes (row 4h + s: step s of half h, prepared once per activation
by `tile_activation_row`), so row i of the int32 result C is row i's block sum for each of the 16 tokens. The
float work is then the VNNI kernel's, with the vector running over tokens instead of rows. Q6_K, whose halves
have scales of their own, keeps one group a call and the VNNI kernel's lanes: A row i is lane i (row i // 2,
half i % 2) with zeros in the other half's K positions, and each row's two lanes are scaled apart and added at
the end.

Two phases per pair of groups and pass of tokens: `unpack` writes the A tiles, row scales and mins into scratch
once; the products then load each block's A from there for every token tile of the pass. A tile load of bytes
that vector stores have just written waits for those stores to retire (no forwarding: ~30 ns a block on a
Xeon guest (Emerald Rapids), more than the product itself), so A is never built in the loop that loads it; for the
same reason the loop is software-pipelined by one block (block b's scaling reads the C buffer written a block
earlier). The float scaling — per row and 16 tokens a conversion, a multiply and one or two fused
multiply-adds — is what bounds the gain, not AMX's nominal 8x: whole rows as lanes do twice the
multiply-accumulates of half rows for the same float work (bench/micro/amx_scaling.c, docs/performance.md).

`TDPBUSD` multiplies unsigned bytes of A by signed bytes of B, as `vpdpbusd` multiplies the weights' unsigned
bytes by the activations' signed ones. Tile registers are named by immediates: C0, A0, B0 are tmm0..tmm2,
configured per call by `ldtilecfg` and released at its end (a thread that leaves its tiles dirty makes every
context switch save 8 KiB).

The hardware kernel is an LLVM function of its own with AMX in its target features, so it compiles on every x86
CPU and runs only where `decoding.kernels.amx_probe` found AMX granted and the kernel's results right. The
emulated kernel is the same IR with each tile instruction written as vector IR over stack buffers: it runs
everywhere, so the kernel's data layout, loops and float sequence are tested on CPUs without AMX (tests/test_amx.py);
only the six tile instructions are left to the machines that have them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import binding, ir
from llvmlite.ir.values import FunctionAttributes
from numba import njit, types
from numba.extending import intrinsic

from kvcache.int8_dot import dpbusd_emitter
from threadpool.atomics import cache_aligned_zeros

from ..model.quant import QType
from .vnni import (
    GROUP_ROWS,
    HALF_SCALES,
    UNSIGNED_BIAS,
    array_byte_pointer,
    block_scales,
    close_block_loop,
    fused_multiply_add,
    lane_mask,
    load_at,
    open_block_loop,
    prefetch_ahead,
    splat,
    vec,
    weight_vector,
)

TILE_TOKENS = 16
TILE_ROWS = 16  # weight rows a tile product covers: two 8-row groups (one for HALF_SCALES types, as 16 lanes)
# Below two tiles a call, the VNNI kernels are faster: each pass unpacks every weight group into the tiles'
# layout before its tiles' products, where the VNNI kernels compute as the weights arrive (Emerald Rapids Xeon
# guest, 2 threads, the 1.5B shape: decode steps of 16 and 24 streams 0.86-0.89x with the tiles, of 32 1.18-1.37x,
# of 48 1.40x; docs/performance.md)
FEWEST_TILED_TOKENS = 2 * TILE_TOKENS
HARDWARE, EMULATED = 1, 2  # TileActivations.mode: 0 is no tiles
C0, A0, B0 = range(3)
# (rows, bytes a row): C is 16 rows (or Q6_K's lanes) × 16 tokens int32, A 16 rows × 32 weight bytes, B 8 × 16
# tokens × 4 activation bytes
TILE_SHAPES = {C0: (16, 64), A0: (16, 32), B0: (8, 64)}
UNPACKED_A_BYTES = 16 * 32
# unpacked bytes per block: the A tile, its 16 rows' (lanes') scales and mins
UNPACKED_FLOATS_PER_BLOCK = (UNPACKED_A_BYTES + 64 + 64) // 4
# one block of a token tile's activations, its B tile: row 4h + s is step s of half h, 16 tokens × 4 bytes
TILE_BLOCK_BYTES = 2 * 4 * TILE_TOKENS * 4

_i8, _i32, _i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_i8p = _i8.as_pointer()


class TileActivations(NamedTuple):
    """Activations in the tiles' layout, written by `tile_activation_row` beside the row-major ones; empty
    arrays and mode 0 where the tiles are not used."""

    mode: int  # 0: none; HARDWARE; EMULATED
    fewest_tokens: int  # a call with fewer tokens runs on the VNNI kernels alone (the same numbers)
    xq: np.ndarray  # (tiles, blocks, 2, 4, 16) int32: B0 and B1 of each token tile and block
    xd: np.ndarray  # (tiles, blocks, 16) float32 the 16 tokens' scales
    mass: np.ndarray  # (tiles, blocks, 16) float32 their scale · Σq (the min term's)
    half_sums: np.ndarray  # (tiles, blocks, 2, 16) int32 Σq over each half of the block (the storage offsets')


def tile_activations(mode: int, max_tokens: int, widest: int, fewest_tokens: int | None = None) -> TileActivations:
    """Room for `max_tokens` activations of up to `widest` columns in the tiles' layout. `fewest_tokens`: the
    fewest tokens a call takes through the tiles (default FEWEST_TILED_TOKENS on hardware; one tile in the
    emulation, which exists to test the tiles' numbers, not their speed)."""
    if fewest_tokens is None:
        fewest_tokens = FEWEST_TILED_TOKENS if mode == HARDWARE else TILE_TOKENS
    tiles, blocks = (max_tokens // TILE_TOKENS, widest // 32) if mode else (0, 0)
    # on 64-byte boundaries, as every tile row then is: tile loads whose rows straddle cache lines cost ~20% more
    return TileActivations(mode, fewest_tokens, cache_aligned_zeros((tiles, blocks, 2, 4, TILE_TOKENS), np.int32),
                           cache_aligned_zeros((tiles, blocks, TILE_TOKENS), np.float32),
                           cache_aligned_zeros((tiles, blocks, TILE_TOKENS), np.float32),
                           cache_aligned_zeros((tiles, blocks, 2, TILE_TOKENS), np.int32))  # fmt: skip


def tile_scratch(n_threads: int, mode: int, widest: int, max_tokens: int) -> np.ndarray:
    """Per thread, two float32 scratch rows for the tiles (a gated feed-forward's gate and up): a pass's
    results, up to 16 rows × 16 tokens per token tile, from the start; the unpacked rows at the end, on a
    64-byte boundary as the A tiles' loads want it (every row's length is a multiple of 16 floats, and so is
    the unpacked length). Empty where the tiles are not used."""
    results = (max_tokens // TILE_TOKENS) * TILE_ROWS * TILE_TOKENS
    floats = results + (widest // 32) * UNPACKED_FLOATS_PER_BLOCK if mode else 0
    return cache_aligned_zeros((n_threads, 2, floats), np.float32)


@njit(nogil=True, cache=True)
def tiles_from(tiles, first_token):
    """The activations from token `first_token` on (a whole tile's first token): a view, token 0 its first."""
    first = first_token // TILE_TOKENS
    return TileActivations(tiles.mode, tiles.fewest_tokens, tiles.xq[first:], tiles.xd[first:], tiles.mass[first:],
                           tiles.half_sums[first:])  # fmt: skip


@njit(nogil=True, cache=True)
def tile_activation_row(tiles, t, n_cols, xq, xd, xsum):
    """Copy token t's quantized row (xq in ACTIVATION_ORDER, its block fields: fast_kernels.activation_arrays)
    into its tile's layout: byte 8s + 4h + j of a block is step s, half h, so B_h row s of token n is the
    row's int32 word 2s + h."""
    tile, n = t // TILE_TOKENS, t % TILE_TOKENS
    words = xq[:n_cols].view(np.int32)
    for b in range(n_cols // 32):
        for h in range(2):
            for s in range(4):
                tiles.xq[tile, b, h, s, n] = words[8 * b + 2 * s + h]
            tiles.half_sums[tile, b, h, n] = xsum[b, h]
        tiles.xd[tile, b, n] = xd[b, 0]
        tiles.mass[tile, b, n] = xd[b, 1]


@njit(nogil=True, cache=True)
def tile_activation_tile(tiles, tile, n_cols, xq, xd, xsum):
    """tile_activation_row for the 16 tokens of one tile at once: each line of the tiles' layout is written
    whole, where a row at a time writes one word into each of a block's 8 lines."""
    first = tile * TILE_TOKENS
    words = xq[first : first + TILE_TOKENS].view(np.int32)
    for b in range(n_cols // 32):
        for h in range(2):
            for s in range(4):
                for n in range(TILE_TOKENS):
                    tiles.xq[tile, b, h, s, n] = words[n, 8 * b + 2 * s + h]
            for n in range(TILE_TOKENS):
                tiles.half_sums[tile, b, h, n] = xsum[first + n, b, h]
        for n in range(TILE_TOKENS):
            tiles.xd[tile, b, n] = xd[first + n, b, 0]
            tiles.mass[tile, b, n] = xd[first + n, b, 1]


@njit(nogil=True, cache=True)
def tile_activation_rows(tiles, row_begin, row_end, n_tiled, n_cols, xq, xd, xsum):
    """The tiles' copy of rows [row_begin, row_end) below n_tiled (xq, xd, xsum: every token's rows): the tiles
    wholly inside the range at once, the rows of a tile it shares with another range (another thread's) one at
    a time."""
    copy_end = min(row_end, n_tiled)
    whole_begin = min(-(-row_begin // TILE_TOKENS) * TILE_TOKENS, copy_end)
    whole_end = max(whole_begin, copy_end // TILE_TOKENS * TILE_TOKENS)
    for t in range(row_begin, whole_begin):
        tile_activation_row(tiles, t, n_cols, xq[t], xd[t], xsum[t])
    for tile in range(whole_begin // TILE_TOKENS, whole_end // TILE_TOKENS):
        tile_activation_tile(tiles, tile, n_cols, xq, xd, xsum)
    for t in range(whole_end, copy_end):
        tile_activation_row(tiles, t, n_cols, xq[t], xd[t], xsum[t])


class _HardwareTiles:
    """The tile instructions themselves."""

    name = "amx"

    def __init__(self, builder: ir.IRBuilder):
        self.builder = builder
        module = builder.module

        def declare(name: str, args: list[ir.Type]) -> ir.Function:
            existing = module.globals.get(name)
            return existing if existing is not None else ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)

        self._config = declare("llvm.x86.ldtilecfg", [_i8p])
        self._zero = declare("llvm.x86.tilezero", [_i8])
        self._tile_load = declare("llvm.x86.tileloadd64", [_i8, _i8p, _i64])
        self._store = declare("llvm.x86.tilestored64", [_i8, _i8p, _i64])
        self._dot = declare("llvm.x86.tdpbusd", [_i8, _i8, _i8])
        self._release = declare("llvm.x86.tilerelease", [])

    def configure(self) -> None:
        config = [0] * 64
        config[0] = 1  # palette 1
        for tile, (rows, row_bytes) in TILE_SHAPES.items():
            config[16 + 2 * tile], config[17 + 2 * tile] = row_bytes & 0xFF, row_bytes >> 8
            config[48 + tile] = rows
        slot = self.builder.alloca(vec(_i8, 64))
        slot.align = 64
        self.builder.store(ir.Constant(vec(_i8, 64), config), slot)
        self.builder.call(self._config, [self.builder.bitcast(slot, _i8p)])

    def zero(self, tile: int) -> None:
        self.builder.call(self._zero, [ir.Constant(_i8, tile)])

    def load(self, tile: int, ptr: ir.Value, stride: int) -> None:
        self.builder.call(self._tile_load, [ir.Constant(_i8, tile), ptr, ir.Constant(_i64, stride)])

    def store(self, tile: int, ptr: ir.Value, stride: int) -> None:
        self.builder.call(self._store, [ir.Constant(_i8, tile), ptr, ir.Constant(_i64, stride)])

    def dot(self, c: int, a: int, b: int) -> None:
        self.builder.call(self._dot, [ir.Constant(_i8, c), ir.Constant(_i8, a), ir.Constant(_i8, b)])

    def release(self) -> None:
        self.builder.call(self._release, [])


class _EmulatedTiles:
    """The tile instructions as vector IR over 1 KiB stack buffers, one per tile register: what the Intel manual
    says each does, for the shapes configured in TILE_SHAPES (TDPBUSD: C[m][n] += Σ_k A[m][4k+j] · B[k][4n+j],
    unsigned A, signed B, int32 sums without saturation)."""

    name = "emulated"

    def __init__(self, builder: ir.IRBuilder):
        self.builder = builder
        self.registers = {}

    def configure(self) -> None:
        for tile in TILE_SHAPES:
            slot = self.builder.alloca(ir.ArrayType(_i8, 1024))
            slot.align = 64
            self.registers[tile] = self.builder.bitcast(slot, _i8p)

    def _row(self, tile: int, row: int) -> ir.Value:
        return self.builder.gep(self.registers[tile], [ir.Constant(_i64, 64 * row)])

    def zero(self, tile: int) -> None:
        rows, row_bytes = TILE_SHAPES[tile]
        for r in range(rows):
            ptr = self.builder.bitcast(self._row(tile, r), vec(_i8, row_bytes).as_pointer())
            self.builder.store(ir.Constant(vec(_i8, row_bytes), [0] * row_bytes), ptr)

    def _copy(self, src_rows, dst_rows, rows: int, row_bytes: int) -> None:
        for r in range(rows):
            ty = vec(_i8, row_bytes).as_pointer()
            self.builder.store(self.builder.load(self.builder.bitcast(src_rows(r), ty), align=1),
                               self.builder.bitcast(dst_rows(r), ty), align=1)

    def load(self, tile: int, ptr: ir.Value, stride: int) -> None:
        rows, row_bytes = TILE_SHAPES[tile]
        self._copy(lambda r: self.builder.gep(ptr, [ir.Constant(_i64, stride * r)]), lambda r: self._row(tile, r),
                   rows, row_bytes)

    def store(self, tile: int, ptr: ir.Value, stride: int) -> None:
        rows, row_bytes = TILE_SHAPES[tile]
        self._copy(lambda r: self._row(tile, r), lambda r: self.builder.gep(ptr, [ir.Constant(_i64, stride * r)]),
                   rows, row_bytes)

    def dot(self, c: int, a: int, b: int) -> None:
        builder = self.builder
        rows, _ = TILE_SHAPES[c]
        k_words = TILE_SHAPES[a][1] // 4
        dpbusd = dpbusd_emitter(builder, 255)
        b_rows = [builder.load(builder.bitcast(self._row(b, k), vec(_i8, 64).as_pointer())) for k in range(k_words)]
        for m in range(rows):
            c_ptr = builder.bitcast(self._row(c, m), vec(_i32, 16).as_pointer())
            acc = builder.load(c_ptr)
            a_words = builder.load(builder.bitcast(self._row(a, m), vec(_i32, k_words).as_pointer()))
            for k in range(k_words):
                word = builder.extract_element(a_words, ir.Constant(_i32, k))
                acc = dpbusd(acc, builder.bitcast(splat(builder, word, 16), vec(_i8, 64)), b_rows[k])
            builder.store(acc, c_ptr)

    def release(self) -> None:
        pass


def _amx_features() -> str:
    features = binding.get_host_cpu_features()
    features["amx-tile"] = features["amx-int8"] = True
    return features.flatten()


class _TargetFeatures(FunctionAttributes):
    """Function attributes plus a "target-features" string (llvmlite knows only LLVM's enum attributes)."""

    def __init__(self, features: str):
        super().__init__(["noinline", "nounwind"])
        self.features = features

    def _to_list(self, ret_type):
        return [*super()._to_list(ret_type), f'"target-features"="{self.features}"']


def _define_unpack(module: ir.Module, qtype: QType) -> ir.Function:
    """void f(i8* weights, i64 second_group, i64 blocks, i8* unpacked): A tiles (16 lanes × 32 bytes a block, at
    UNPACKED_A_BYTES · block), then the lanes' scales (64 bytes a block) and mins (64 bytes a block, zero where
    the type has none) — what every token tile of a pass multiplies them by.

    A type with a scale per row (every one but HALF_SCALES): the lanes are 16 whole rows, those of the 8-row
    group at `weights` and of the one `second_group` bytes past it. Q6_K (a scale per half row): the lanes are
    the VNNI kernel's of the one group at `weights` (lane 2r + h: row r's half h), each with the other half's
    K positions zero."""
    name = f"treadle_tile_unpack_{qtype.name.lower()}"
    existing = module.globals.get(name)
    if existing is not None:
        return existing
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_i8p, _i64, _i64, _i8p]), name)
    fn.linkage = "internal"
    w_base, second_group, n_blocks, unpacked = fn.args
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    row_sums = qtype not in HALF_SCALES
    # the B rows' K order: word 4h + s is step s of half h. steps[s] word 2r + h is row r's (step s, half h).
    if row_sums:  # A row r: its 8 words in K order
        a_mask = lane_mask([16 * (w % 4) + 2 * r + w // 4 for r in range(GROUP_ROWS) for w in range(8)])
    else:  # A row i (lane i: row i // 2, half i % 2): its four words where h is its half, zeros where not
        a_mask = lane_mask([16 * (w % 4) + i if w // 4 == i % 2 else 64 for i in range(16) for w in range(8)])
    zeros = ir.Constant(vec(_i32, 64), [0] * 64)
    scales_at = builder.mul(n_blocks, ir.Constant(_i64, UNPACKED_A_BYTES))
    mins_at = builder.add(scales_at, builder.mul(n_blocks, ir.Constant(_i64, 64)))
    blocks = open_block_loop(builder, n_blocks, 0)
    block = blocks.block
    a_ptr = builder.gep(unpacked, [builder.mul(block, ir.Constant(_i64, UNPACKED_A_BYTES))])
    block_bytes = builder.mul(block, ir.Constant(_i64, 64))
    for group in range(2 if row_sums else 1):
        group_base = builder.gep(w_base, [second_group]) if group else w_base
        block_ptr, scales, mins = block_scales(builder, qtype, group_base, block)
        prefetch_ahead(builder, qtype, block_ptr)
        steps = [builder.bitcast(weight_vector(builder, qtype, block_ptr, s), vec(_i32, 16)) for s in range(4)]
        low, high = (builder.shuffle_vector(steps[0], steps[1], lane_mask(list(range(32)))),
                     builder.shuffle_vector(steps[2], steps[3], lane_mask(list(range(32)))))  # fmt: skip
        all_steps = builder.shuffle_vector(low, high, lane_mask(list(range(64))))  # word 16s + 2r + h
        a_rows = builder.shuffle_vector(all_steps, zeros, a_mask)
        group_a = builder.gep(a_ptr, [ir.Constant(_i64, 4 * a_rows.type.count * group)])
        builder.store(a_rows, builder.bitcast(group_a, a_rows.type.as_pointer()), align=4)
        for at, values in ((scales_at, scales), (mins_at, mins)):
            if values is None:
                values = ir.Constant(vec(_f32, scales.type.count), [0.0] * scales.type.count)
            ptr = builder.gep(unpacked, [builder.add(at, builder.add(block_bytes, ir.Constant(_i64, 32 * group)))])
            builder.store(values, builder.bitcast(ptr, values.type.as_pointer()), align=4)
    close_block_loop(builder, blocks, n_blocks, [])
    builder.ret_void()
    return fn


def _define_tile_products(module: ir.Module, bias: int, has_mins: bool, row_sums: bool,  # noqa: C901
                          tiles_class) -> ir.Function:  # fmt: skip
    """void f(i8* unpacked, i64 blocks, i8* tile_xq, i8* tile_xd, i8* tile_mass, i8* half_sums, i64 tiles,
    i64 tile_xq_stride, i64 tile_fields_stride, i64 half_sums_stride, i8* out): for each of `tiles` token tiles
    from the given one, out[tile] = rows × 16 tokens float32, the unpacked rows · the tile's tokens: 16 rows
    where the lanes are whole rows (`row_sums`), else 8 (each the sum of its two lanes)."""
    name = f"treadle_tile_products_{bias}_{int(has_mins)}_{int(row_sums)}_{tiles_class.name}"
    existing = module.globals.get(name)
    if existing is not None:
        return existing
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_i8p, _i64, _i8p, _i8p, _i8p, _i8p, _i64, _i64, _i64,
                                                               _i64, _i8p]), name)  # fmt: skip
    fn.linkage = "internal"
    if tiles_class is _HardwareTiles:
        fn.attributes = _TargetFeatures(_amx_features())
    unpacked, n_blocks, bq0, xd0, mass0, hs0, n_tiles, bq_stride, fields_stride, hs_stride, out0 = fn.args
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    tiles = tiles_class(builder)
    tiles.configure()
    c_slot = builder.alloca(vec(_i32, 512))  # two C buffers, each 16 lanes × 16 tokens
    c_slot.align = 64
    c_bufs = builder.bitcast(c_slot, _i8p)
    fma = fused_multiply_add(builder)
    scales_at = builder.mul(n_blocks, ir.Constant(_i64, UNPACKED_A_BYTES))
    mins_at = builder.add(scales_at, builder.mul(n_blocks, ir.Constant(_i64, 64)))

    entry = builder.block
    tile_loop, tiles_done = builder.append_basic_block("token_tiles"), builder.append_basic_block("token_tiles_done")
    any_work = builder.and_(builder.icmp_signed(">", n_tiles, ir.Constant(_i64, 0)),
                            builder.icmp_signed(">", n_blocks, ir.Constant(_i64, 0)))  # fmt: skip
    builder.cbranch(any_work, tile_loop, tiles_done)
    builder.position_at_end(tile_loop)
    tile = builder.phi(_i64)
    tile.add_incoming(ir.Constant(_i64, 0), entry)
    bq_base = builder.gep(bq0, [builder.mul(tile, bq_stride)])
    xd_base, mass_base = (builder.gep(base, [builder.mul(tile, fields_stride)]) for base in (xd0, mass0))
    hs_base = builder.gep(hs0, [builder.mul(tile, hs_stride)])

    def products(block: ir.Value) -> None:
        """The block's int32 lane sums for the 16 tokens, into C buffer block % 2."""
        tiles.load(A0, builder.gep(unpacked, [builder.mul(block, ir.Constant(_i64, UNPACKED_A_BYTES))]),
                   TILE_SHAPES[A0][1])  # fmt: skip
        tiles.load(B0, builder.gep(bq_base, [builder.mul(block, ir.Constant(_i64, TILE_BLOCK_BYTES))]), 64)
        tiles.zero(C0)
        tiles.dot(C0, A0, B0)
        tiles.store(C0, c_buffer(block), 64)

    def c_buffer(block: ir.Value) -> ir.Value:
        return builder.gep(c_bufs, [builder.mul(builder.and_(block, ir.Constant(_i64, 1)), ir.Constant(_i64, 1024))])

    def scaled(block: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
        """The accumulators after the VNNI kernel's operations on each lane of the block, for 16 tokens at once:
        the same bits."""
        c_buf = c_buffer(block)
        token_bytes = builder.mul(block, ir.Constant(_i64, 64))
        x_scale = load_at(builder, xd_base, token_bytes, vec(_f32, 16), align=4)
        if bias:
            half_bytes = builder.mul(block, ir.Constant(_i64, 128))
            offsets = [builder.mul(load_at(builder, hs_base, builder.add(half_bytes, ir.Constant(_i64, 64 * h)),
                                           vec(_i32, 16), align=4), ir.Constant(vec(_i32, 16), [-bias] * 16))
                       for h in range(2)]  # fmt: skip
            if row_sums:  # a whole row's: both halves'
                offsets = [builder.add(offsets[0], offsets[1])] * 2
        if has_mins:
            x_mass = load_at(builder, mass_base, token_bytes, vec(_f32, 16), align=4)
        lane_scales = builder.add(scales_at, token_bytes)
        lane_mins = builder.add(mins_at, token_bytes)
        next_accs = []
        for lane in range(16):
            acc_i = load_at(builder, c_buf, 64 * lane, vec(_i32, 16), align=64)
            if bias:
                acc_i = builder.add(offsets[lane % 2], acc_i)
            # scalars from memory, splat: broadcasts that take a load port, not a shuffle unit
            lane_scale = splat(builder, load_at(builder, unpacked, builder.add(lane_scales, ir.Constant(
                _i64, 4 * lane)), _f32, align=4), 16)  # fmt: skip
            acc = builder.call(fma, [builder.sitofp(acc_i, vec(_f32, 16)), builder.fmul(lane_scale, x_scale),
                                     accs[lane]])  # fmt: skip
            # in the lanes' form an odd lane's min is 0, and fma(0, m, acc) is acc: acc is never -0
            if has_mins and (row_sums or lane % 2 == 0):
                lane_min = splat(builder, load_at(builder, unpacked, builder.add(lane_mins, ir.Constant(
                    _i64, 4 * lane)), _f32, align=4), 16)  # fmt: skip
                acc = builder.call(fma, [lane_min, x_mass, acc])
            next_accs.append(acc)
        return next_accs

    # Software-pipelined by one block: a tile store's bytes reach loads only once it has retired (no forwarding),
    # so block b's scaling reads C buffer b % 2 while block b + 1's product is being formed into the other one.
    products(ir.Constant(_i64, 0))
    blocks = open_block_loop(builder, builder.sub(n_blocks, ir.Constant(_i64, 1)), 16)
    block = builder.add(blocks.block, ir.Constant(_i64, 1))  # accs[i]: lane i (row i, or row i // 2's half i % 2)
    products(block)
    next_accs = scaled(blocks.block, blocks.accs)
    accs = close_block_loop(builder, blocks, builder.sub(n_blocks, ir.Constant(_i64, 1)), next_accs)
    finals = scaled(builder.sub(n_blocks, ir.Constant(_i64, 1)), accs)
    rows = finals if row_sums else [builder.fadd(finals[2 * r], finals[2 * r + 1]) for r in range(8)]
    out_base = builder.gep(out0, [builder.mul(tile, ir.Constant(_i64, 64 * len(rows)))])
    for r, row in enumerate(rows):
        out_ptr = builder.bitcast(builder.gep(out_base, [ir.Constant(_i64, 64 * r)]), vec(_f32, 16).as_pointer())
        builder.store(row, out_ptr, align=4)
    next_tile = builder.add(tile, ir.Constant(_i64, 1))
    tile.add_incoming(next_tile, builder.block)  # the inner loop's exit: the back edge comes from there
    builder.cbranch(builder.icmp_signed("<", next_tile, n_tiles), tile_loop, tiles_done)
    builder.position_at_end(tiles_done)
    tiles.release()
    builder.ret_void()
    return fn


def _make_unpack(qtype: QType):
    @intrinsic
    def unpack(typingctx, weights, weight_offset, second_group, num_blocks, unpacked):
        """unpacked (float32, ≥ UNPACKED_FLOATS_PER_BLOCK · num_blocks) = the 8-row group at `weight_offset`
        (and the one `second_group` bytes past it, but for HALF_SCALES types) in the tiles' layout."""
        sig = types.void(weights, weight_offset, second_group, num_blocks, unpacked)

        def codegen(context, builder, signature, args):
            w_arr, w_off, second, n_blocks, unpacked_arr = args
            w_off = context.cast(builder, w_off, signature.args[1], types.int64)
            second = context.cast(builder, second, signature.args[2], types.int64)
            n_blocks = context.cast(builder, n_blocks, signature.args[3], types.int64)
            w_base = builder.gep(array_byte_pointer(context, builder, signature.args[0], w_arr), [w_off])
            builder.call(_define_unpack(builder.module, qtype), [
                w_base, second, n_blocks, array_byte_pointer(context, builder, signature.args[4], unpacked_arr)])
            return context.get_dummy_value()

        return sig, codegen

    return unpack


def _make_tile_products(bias: int, has_mins: bool, row_sums: bool):
    @intrinsic
    def tile_products(typingctx, unpacked, num_blocks, tiles, first_tile, num_tiles, out):
        """out[i, rows, 0:16] = the unpacked rows (16 with `row_sums`, else 8) · the 16 tokens of token tile
        first_tile + i, for i below num_tiles, by the hardware tiles (tiles.mode == HARDWARE) or their emulation."""
        sig = types.void(unpacked, num_blocks, tiles, first_tile, num_tiles, out)

        def codegen(context, builder, signature, args):
            unpacked_arr, n_blocks, tiles_value, tile_index, n_tiles, out_arr = args
            tiles_type = signature.args[2]
            fields = {name: (builder.extract_value(tiles_value, i), tiles_type.types[i])
                      for i, name in enumerate(TileActivations._fields)}  # fmt: skip
            n_blocks = context.cast(builder, n_blocks, signature.args[1], types.int64)
            tile_index = context.cast(builder, tile_index, signature.args[3], types.int64)
            n_tiles = context.cast(builder, n_tiles, signature.args[4], types.int64)

            def tile_base_and_stride(name: str) -> tuple[ir.Value, ir.Value]:  # arrays are C-contiguous, tile-major
                value, ty = fields[name]
                array = context.make_array(ty)(context, builder, value)
                stride = builder.extract_value(array.strides, 0)
                return builder.gep(builder.bitcast(array.data, _i8p), [builder.mul(tile_index, stride)]), stride

            (bq, bq_stride), (xd, fields_stride), (mass, _), (hs, hs_stride) = (
                tile_base_and_stride(name) for name in ("xq", "xd", "mass", "half_sums"))
            pointers = [array_byte_pointer(context, builder, signature.args[0], unpacked_arr), n_blocks, bq, xd, mass,
                        hs, n_tiles, bq_stride, fields_stride, hs_stride,
                        array_byte_pointer(context, builder, signature.args[5], out_arr)]  # fmt: skip
            mode = context.cast(builder, fields["mode"][0], fields["mode"][1], types.int64)
            hardware = builder.icmp_signed("==", mode, ir.Constant(_i64, HARDWARE))
            with builder.if_else(hardware) as (on_hardware, emulated):
                with on_hardware:
                    builder.call(_define_tile_products(builder.module, bias, has_mins, row_sums, _HardwareTiles),
                                 pointers)  # fmt: skip
                with emulated:
                    builder.call(_define_tile_products(builder.module, bias, has_mins, row_sums, _EmulatedTiles),
                                 pointers)  # fmt: skip
            return context.get_dummy_value()

        return sig, codegen

    return tile_products


unpack_q4_0 = _make_unpack(QType.Q4_0)
unpack_q4_1 = _make_unpack(QType.Q4_1)
unpack_q4_k = _make_unpack(QType.Q4_K)
unpack_q5_0 = _make_unpack(QType.Q5_0)
unpack_q5_1 = _make_unpack(QType.Q5_1)
unpack_q6_k = _make_unpack(QType.Q6_K)
unpack_q8_0 = _make_unpack(QType.Q8_0)
# the products depend on a type only through its storage offset, whether it has a min term and whether it has a
# scale per row (16 rows a tile) or per half row (Q6_K: 8)
tile_products_with_mins = _make_tile_products(0, True, True)
tile_products_offset_8 = _make_tile_products(UNSIGNED_BIAS[QType.Q4_0], False, True)
tile_products_offset_16 = _make_tile_products(UNSIGNED_BIAS[QType.Q5_0], False, True)
tile_products_half_rows_offset_32 = _make_tile_products(UNSIGNED_BIAS[QType.Q6_K], False, False)
tile_products_offset_128 = _make_tile_products(UNSIGNED_BIAS[QType.Q8_0], False, True)
