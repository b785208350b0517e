"""AMX int8 tiles for the `fast` kernels: one 8-row weight group against 16 tokens, bit for bit the VNNI kernel's
numbers (decoding.kernels.vnni).

The VNNI kernel keeps, per row and 32-weight block, two int32 lanes (the row's weights 0..15 and 16..31), scales
each in float32 and adds the pair at the end. A token's numbers must not depend on the batch it runs in, so the
tile kernel forms those same integers and repeats the same float operations: per block it multiplies two tiles of
8 rows × 16 weight bytes (A: lane 2r's bytes for all rows, then lane 2r+1's) by two tiles of 16 tokens' activation
bytes (B, prepared once per activation by `tile_activation_row`), so row r of the int32 result C0 (C1) is lane 2r
(2r+1) of the VNNI kernel for each of the 16 tokens. The float work is then the VNNI kernel's, with the vector
running over tokens instead of lanes: what the tiles save is the four `vpdpbusd`s and activation broadcasts a
token costs per block, not the scaling, which is why the gain is bounded (by the compiled Q4_K loops' instruction
counts, up to ~3x on the matmuls, not AMX's nominal 8x: docs/performance.md).

`TDPBUSD` multiplies unsigned bytes of A by signed bytes of B, as `vpdpbusd` multiplies the weights' unsigned
bytes by the activations' signed ones. Tile registers are named by immediates: C0, C1, A0, A1, B0, B1 are
tmm0..tmm5, configured per call by `ldtilecfg` and released at its end (a thread that leaves its tiles dirty
makes every context switch save 8 KiB).

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

from ..model.quant import QType
from .vnni import (
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
HARDWARE, EMULATED = 1, 2  # TileActivations.mode: 0 is no tiles
C0, C1, A0, A1, B0, B1 = range(6)
TILE_SHAPES = {C0: (8, 64), C1: (8, 64), A0: (8, 16), A1: (8, 16), B0: (4, 64), B1: (4, 64)}  # (rows, bytes a row)
# one block of a token tile's activations: B0 then B1, each 4 rows (steps) × 16 tokens × 4 bytes
TILE_BLOCK_BYTES = 2 * 4 * TILE_TOKENS * 4

_i8, _i32, _i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_i8p = _i8.as_pointer()


class TileActivations(NamedTuple):
    """Activations in the tiles' layout, written by `tile_activation_row` beside the row-major ones; empty
    arrays and mode 0 where the tiles are not used."""

    mode: int  # 0: none; HARDWARE; EMULATED
    xq: np.ndarray  # (tiles, blocks, 2, 4, 16) int32: B0 and B1 of each token tile and block
    xd: np.ndarray  # (tiles, blocks, 16) float32 the 16 tokens' scales
    mass: np.ndarray  # (tiles, blocks, 16) float32 their scale · Σq (the min term's)
    half_sums: np.ndarray  # (tiles, blocks, 2, 16) int32 Σq over each half of the block (the storage offsets')


def tile_activations(mode: int, max_tokens: int, widest: int) -> TileActivations:
    tiles, blocks = (max_tokens // TILE_TOKENS, widest // 32) if mode else (0, 0)
    return TileActivations(mode, np.zeros((tiles, blocks, 2, 4, TILE_TOKENS), dtype=np.int32),
                           np.zeros((tiles, blocks, TILE_TOKENS), dtype=np.float32),
                           np.zeros((tiles, blocks, TILE_TOKENS), dtype=np.float32),
                           np.zeros((tiles, blocks, 2, TILE_TOKENS), dtype=np.int32))  # fmt: skip


@njit(nogil=True, cache=True)
def tiles_from(tiles, first_token):
    """The activations from token `first_token` on (a whole tile's first token): a view, token 0 its first."""
    first = first_token // TILE_TOKENS
    return TileActivations(tiles.mode, tiles.xq[first:], tiles.xd[first:], tiles.mass[first:],
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


def _define_tile_dot(module: ir.Module, qtype: QType, tiles_class) -> ir.Function:  # noqa: C901 - one IR loop
    """void f(i8* weights, i64 blocks, i8* tile_xq, i8* tile_xd, i8* tile_mass, i8* half_sums, i8* out): out is
    8 rows × 16 tokens float32, row r · token n of the group at `weights` for the tile's 16 tokens."""
    name = f"treadle_tile_dot_{qtype.name.lower()}_{tiles_class.name}"
    existing = module.globals.get(name)
    if existing is not None:
        return existing
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [_i8p, _i64, _i8p, _i8p, _i8p, _i8p, _i8p]), name)
    fn.linkage = "internal"
    if tiles_class is _HardwareTiles:
        fn.attributes = _TargetFeatures(_amx_features())
    w_base, n_blocks, bq_base, xd_base, mass_base, hs_base, out_base = fn.args
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    tiles = tiles_class(builder)
    tiles.configure()
    a_slot = builder.alloca(vec(_i32, 64))  # A0 (2 × 16 words) then A1
    a_slot.align = 64
    c_slot = builder.alloca(vec(_i32, 256))  # C0 (8 rows × 16 words) then C1
    c_slot.align = 64
    a_buf, c_buf = builder.bitcast(a_slot, _i8p), builder.bitcast(c_slot, _i8p)
    bias = UNSIGNED_BIAS[qtype]

    blocks = open_block_loop(builder, n_blocks, 16)
    block, accs = blocks.block, blocks.accs  # accs[2r + h]: lane 2r + h of the VNNI kernel, over the 16 tokens

    block_ptr, scales16, mins16 = block_scales(builder, qtype, w_base, block)
    prefetch_ahead(builder, qtype, block_ptr)  # as the VNNI kernels: a batch's step computes while its weights arrive
    steps = [builder.bitcast(weight_vector(builder, qtype, block_ptr, s), vec(_i32, 16)) for s in range(4)]
    # A_h row r = lane 2r + h of the four steps: word 4r + s of A_h is word 2r + h of step s
    low, high = (builder.shuffle_vector(steps[0], steps[1], lane_mask(list(range(32)))),
                 builder.shuffle_vector(steps[2], steps[3], lane_mask(list(range(32)))))  # fmt: skip
    all_steps = builder.shuffle_vector(low, high, lane_mask(list(range(64))))
    a_words = builder.shuffle_vector(all_steps, all_steps, lane_mask(
        [16 * (i % 4) + 2 * ((i % 32) // 4) + i // 32 for i in range(64)]))
    builder.store(a_words, a_slot, align=64)
    tiles.load(A0, a_buf, 16)
    tiles.load(A1, builder.gep(a_buf, [ir.Constant(_i64, 128)]), 16)
    b_ptr = builder.gep(bq_base, [builder.mul(block, ir.Constant(_i64, TILE_BLOCK_BYTES))])
    tiles.load(B0, b_ptr, 64)
    tiles.load(B1, builder.gep(b_ptr, [ir.Constant(_i64, TILE_BLOCK_BYTES // 2)]), 64)
    tiles.zero(C0)
    tiles.zero(C1)
    tiles.dot(C0, A0, B0)
    tiles.dot(C1, A1, B1)
    tiles.store(C0, c_buf, 64)
    tiles.store(C1, builder.gep(c_buf, [ir.Constant(_i64, 512)]), 64)

    token_bytes = builder.mul(block, ir.Constant(_i64, 64))
    x_scale = load_at(builder, xd_base, token_bytes, vec(_f32, 16), align=4)
    if bias:
        half_bytes = builder.mul(block, ir.Constant(_i64, 128))
        offsets = [builder.mul(load_at(builder, hs_base, builder.add(half_bytes, ir.Constant(_i64, 64 * h)),
                                       vec(_i32, 16), align=4), ir.Constant(vec(_i32, 16), [-bias] * 16))
                   for h in range(2)]  # fmt: skip
    if mins16 is not None:
        x_mass = load_at(builder, mass_base, token_bytes, vec(_f32, 16), align=4)
    fma = fused_multiply_add(builder)
    next_accs = []
    for lane in range(16):  # the VNNI kernel's operations on its lane, for 16 tokens at once: the same bits
        r, h = lane // 2, lane % 2
        acc_i = load_at(builder, c_buf, 512 * h + 64 * r, vec(_i32, 16), align=64)
        if bias:
            acc_i = builder.add(offsets[h], acc_i)
        lane_scale = splat(builder, builder.extract_element(scales16, ir.Constant(_i32, lane)), 16)
        acc = builder.call(fma, [builder.sitofp(acc_i, vec(_f32, 16)), builder.fmul(lane_scale, x_scale), accs[lane]])
        if mins16 is not None:
            lane_min = splat(builder, builder.extract_element(mins16, ir.Constant(_i32, lane)), 16)
            acc = builder.call(fma, [lane_min, x_mass, acc])
        next_accs.append(acc)
    finals = close_block_loop(builder, blocks, n_blocks, next_accs)
    for r in range(8):
        row = builder.fadd(finals[2 * r], finals[2 * r + 1])
        out_ptr = builder.bitcast(builder.gep(out_base, [ir.Constant(_i64, 64 * r)]), vec(_f32, 16).as_pointer())
        builder.store(row, out_ptr, align=4)
    tiles.release()
    builder.ret_void()
    return fn


def _make_tile_dot(qtype: QType):
    @intrinsic
    def tile_dot(typingctx, weights, weight_offset, num_blocks, tiles, tile, out):
        """out[0:8, 0:16] = the 8 rows of the group at `weight_offset` · the 16 tokens of token tile `tile`, by the
        hardware tiles (tiles.mode == HARDWARE) or their emulation."""
        sig = types.void(weights, weight_offset, num_blocks, tiles, tile, out)

        def codegen(context, builder, signature, args):
            w_arr, w_off, n_blocks, tiles_value, tile_index, out_arr = args
            tiles_type = signature.args[3]
            fields = {name: (builder.extract_value(tiles_value, i), tiles_type.types[i])
                      for i, name in enumerate(TileActivations._fields)}  # fmt: skip
            w_off = context.cast(builder, w_off, signature.args[1], types.int64)
            n_blocks = context.cast(builder, n_blocks, signature.args[2], types.int64)
            tile_index = context.cast(builder, tile_index, signature.args[4], types.int64)
            w_base = builder.gep(array_byte_pointer(context, builder, signature.args[0], w_arr), [w_off])

            def tile_base(name: str) -> ir.Value:  # the tile's first byte: arrays are C-contiguous, tile-major
                value, ty = fields[name]
                array = context.make_array(ty)(context, builder, value)
                stride = builder.extract_value(array.strides, 0)
                return builder.gep(builder.bitcast(array.data, _i8p), [builder.mul(tile_index, stride)])

            pointers = [w_base, n_blocks, tile_base("xq"), tile_base("xd"), tile_base("mass"), tile_base("half_sums"),
                        array_byte_pointer(context, builder, signature.args[5], out_arr)]  # fmt: skip
            mode = context.cast(builder, fields["mode"][0], fields["mode"][1], types.int64)
            hardware = builder.icmp_signed("==", mode, ir.Constant(_i64, HARDWARE))
            with builder.if_else(hardware) as (on_hardware, emulated):
                with on_hardware:
                    builder.call(_define_tile_dot(builder.module, qtype, _HardwareTiles), pointers)
                with emulated:
                    builder.call(_define_tile_dot(builder.module, qtype, _EmulatedTiles), pointers)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


tile_dot_q4_0 = _make_tile_dot(QType.Q4_0)
tile_dot_q4_1 = _make_tile_dot(QType.Q4_1)
tile_dot_q4_k = _make_tile_dot(QType.Q4_K)
tile_dot_q5_0 = _make_tile_dot(QType.Q5_0)
tile_dot_q5_1 = _make_tile_dot(QType.Q5_1)
tile_dot_q6_k = _make_tile_dot(QType.Q6_K)
tile_dot_q8_0 = _make_tile_dot(QType.Q8_0)
