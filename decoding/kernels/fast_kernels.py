"""The `fast` kernels: activations quantized to int8 per 32-block, VNNI dot products with repacked weights.

Like llama.cpp's CPU path: each activation row is quantized once per matrix it feeds (Q8_0-style,
scale = max|x| / 127, round half away from zero), then every 8-row weight group is dotted with up to
eight tokens at a time (decoding.kernels.vnni), or sixteen through AMX tiles where the CPU grants
them (decoding.kernels.amx). A row's numbers never depend on the batch: a token's
quantization and dot products are the same operations whether it is alone or among many.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcache.fastmath import exp_f32

from ..model.quant import QType
from .activation_blocks import block_abs_max, quantize_block
from .amx import (
    TILE_TOKENS,
    UNPACKED_FLOATS_PER_BLOCK,
    tile_activation_rows,
    tile_products_half_rows_offset_32,
    tile_products_offset_8,
    tile_products_offset_16,
    tile_products_offset_128,
    tile_products_with_mins,
    unpack_q4_0,
    unpack_q4_1,
    unpack_q4_k,
    unpack_q5_0,
    unpack_q5_1,
    unpack_q6_k,
    unpack_q8_0,
)
from .kernels import gate_sigmoid_argument
from .vnni import (
    BLOCK_STRIDE,
    group_dot_q4_0_x1,
    group_dot_q4_0_x4,
    group_dot_q4_0_x8,
    group_dot_q4_1_x1,
    group_dot_q4_1_x4,
    group_dot_q4_1_x8,
    group_dot_q4_k_x1,
    group_dot_q4_k_x4,
    group_dot_q4_k_x8,
    group_dot_q5_0_x1,
    group_dot_q5_0_x4,
    group_dot_q5_0_x8,
    group_dot_q5_1_x1,
    group_dot_q5_1_x4,
    group_dot_q5_1_x8,
    group_dot_q6_k_x1,
    group_dot_q6_k_x4,
    group_dot_q6_k_x8,
    group_dot_q8_0_x1,
    group_dot_q8_0_x4,
    group_dot_q8_0_x8,
)

Q4_0, Q4_1, Q5_0, Q8_0 = int(QType.Q4_0), int(QType.Q4_1), int(QType.Q5_0), int(QType.Q8_0)
Q5_1, Q6_K, Q4_K = int(QType.Q5_1), int(QType.Q6_K), int(QType.Q4_K)
# bytes of one (8-row group, 32-weight block) of each packed type, indexed by type id (numba freezes it)
_GROUP_BLOCK_BYTES = np.zeros(max(BLOCK_STRIDE) + 1, dtype=np.int64)
for _qtype, _stride in BLOCK_STRIDE.items():
    _GROUP_BLOCK_BYTES[int(_qtype)] = _stride


def activation_arrays(tokens: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zeroed (xq, xd, xsum) for `tokens` rows of up to `cols` activations, as quantize_activation_row fills
    them: xq (tokens, cols) int8; xd (tokens, cols // 32, 2) float32, each block's scale d and mass d·Σq;
    xsum (tokens, cols // 32, 2) int32, Σq over the block's weights 0..15 and over 16..31."""
    return (np.zeros((tokens, cols), np.int8), np.zeros((tokens, cols // 32, 2), np.float32),
            np.zeros((tokens, cols // 32, 2), np.int32))  # fmt: skip


@njit(nogil=True, cache=True, fastmath={"nnan", "ninf", "nsz"})
def quantize_activation_row(x, n_cols, xq, xd, xsum):
    """x: (≥n_cols,) float32 → xq (n_cols,) int8 in ACTIVATION_ORDER per block; per block xd (scale, scale·Σq)
    and xsum (Σq of weights 0..15, of 16..31): what the kernels need of a block besides its bytes, computed
    once for every matrix row it meets.

    Step s of a block holds weights 4s..4s+3 then 16+4s..16+4s+3 (decoding.kernels.repack), so byte 8s+k of
    the block is x[4s+k] and byte 8s+4+k is x[16+4s+k].
    """
    for b in range(n_cols // 32):
        base = b * 32
        amax = block_abs_max(x, base)
        scale = amax / np.float32(127.0)
        inverse = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        quantize_block(x, base, inverse, xq, xsum, b)  # rounded half away from zero, as llama.cpp's roundf
        xd[b, 0] = scale
        xd[b, 1] = np.float32(xsum[b, 0] + xsum[b, 1]) * scale


@njit(nogil=True, cache=True)
def group_stride(qtype, n_blocks):
    return _GROUP_BLOCK_BYTES[qtype] * n_blocks


@njit(nogil=True, cache=True)
def group_dot(packed, qtype, offset, n_blocks, xq, xd, xsum, token, num_tokens, out):
    """out[k, :8] for tokens token..token+num_tokens-1 (num_tokens is 1, 4 or 8)."""
    if qtype == Q4_1:
        if num_tokens == 8:
            group_dot_q4_1_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q4_1_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q4_1_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)
    elif qtype == Q4_K:
        if num_tokens == 8:
            group_dot_q4_k_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q4_k_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q4_k_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)
    elif qtype == Q6_K:
        if num_tokens == 8:
            group_dot_q6_k_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q6_k_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q6_k_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)
    elif qtype == Q5_1:
        if num_tokens == 8:
            group_dot_q5_1_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q5_1_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q5_1_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)
    elif qtype == Q5_0:
        if num_tokens == 8:
            group_dot_q5_0_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q5_0_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q5_0_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)
    elif qtype == Q8_0:
        if num_tokens == 8:
            group_dot_q8_0_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q8_0_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q8_0_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)
    else:
        if num_tokens == 8:
            group_dot_q4_0_x8(packed, offset, n_blocks, xq, xd, xsum, token, out)
        elif num_tokens == 4:
            group_dot_q4_0_x4(packed, offset, n_blocks, xq, xd, xsum, token, out)
        else:
            group_dot_q4_0_x1(packed, offset, n_blocks, xq, xd, xsum, token, out)


@njit(nogil=True, cache=True)
def groups_per_tile_call(qtype):
    """8-row groups one tile call multiplies: two (16 whole rows), but one for Q6_K, whose lanes are half rows."""
    return 1 if qtype == Q6_K else 2


@njit(nogil=True, cache=True)
def tile_group_products(packed, qtype, offset, stride, n_blocks, tiles, first_tile, n_tiles, scratch):
    """The groups_per_tile_call(qtype) groups from `offset` (`stride` bytes apart; the first twice where a second
    would be past the end, its results then unused) · token tiles first_tile.. first_tile + n_tiles - 1
    (decoding.kernels.amx): unpacked once into the end of `scratch` (a row of amx.tile_scratch), then each
    tile's results at its start; returns those results, (n_tiles, 8 · groups, 16)."""
    unpacked = scratch[scratch.shape[0] - n_blocks * UNPACKED_FLOATS_PER_BLOCK :]
    rows = 8 * groups_per_tile_call(qtype)
    results = scratch[: n_tiles * rows * TILE_TOKENS]
    if qtype == Q4_1:
        unpack_q4_1(packed, offset, stride, n_blocks, unpacked)
        tile_products_with_mins(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    elif qtype == Q4_K:
        unpack_q4_k(packed, offset, stride, n_blocks, unpacked)
        tile_products_with_mins(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    elif qtype == Q6_K:
        unpack_q6_k(packed, offset, stride, n_blocks, unpacked)
        tile_products_half_rows_offset_32(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    elif qtype == Q5_1:
        unpack_q5_1(packed, offset, stride, n_blocks, unpacked)
        tile_products_with_mins(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    elif qtype == Q5_0:
        unpack_q5_0(packed, offset, stride, n_blocks, unpacked)
        tile_products_offset_16(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    elif qtype == Q8_0:
        unpack_q8_0(packed, offset, stride, n_blocks, unpacked)
        tile_products_offset_128(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    else:
        unpack_q4_0(packed, offset, stride, n_blocks, unpacked)
        tile_products_offset_8(unpacked, n_blocks, tiles, first_tile, n_tiles, results)
    return results.reshape((n_tiles, rows, TILE_TOKENS))


# the activations one pass over a thread's weight groups keeps in its L2: a prompt's rows in passes of
# this many bytes, so each 8-row group meets them from L2, not from L3 (a 512-token row set of a 7B's
# down projection is 14 MB); the weights, a few bytes per 64 multiply-accumulates, are re-read per pass
ACTIVATION_PASS_BYTES = 384 * 1024
# through AMX tiles, more: each group is unpacked into the tiles' layout once per pass (decoding.kernels.amx), and
# the CPUs that have AMX have 2 MB of L2 a core
TILE_PASS_BYTES = 1024 * 1024


@njit(nogil=True, cache=True)
def tokens_per_pass(n_cols, tiled=False):
    """Tokens in one pass of matmul_groups: whole tiles of 16, whose activations (n_cols int8 and 16 bytes a
    block beside them) fit ACTIVATION_PASS_BYTES (TILE_PASS_BYTES where the step's tiles are in use, for the
    calls that take them and those that do not alike: such CPUs have the L2 for it); at least one tile. Every
    token keeps its 8-, 4- and 1-token steps, so its numbers do not change."""
    budget = TILE_PASS_BYTES if tiled else ACTIVATION_PASS_BYTES
    return max(1, budget // ((n_cols + n_cols // 2) * TILE_TOKENS)) * TILE_TOKENS


@njit(nogil=True, cache=True)
def tiled_tokens(tiles, n_tokens, n_cols):
    """How many of the first tokens of activations n_cols wide go through the tiles: whole tiles of 16, where
    tiles are in use, the call has at least tiles.fewest_tokens and a pass (tokens_per_pass) can hold that
    many — rows so long that it cannot (a 32B's down projection, 27,648 columns) never take the tiles, so
    their activations are not copied into the tiles' layout either."""
    if tiles.mode == 0 or n_tokens < tiles.fewest_tokens or tokens_per_pass(n_cols, True) < tiles.fewest_tokens:
        return 0
    return (n_tokens // TILE_TOKENS) * TILE_TOKENS


@njit(nogil=True, cache=True)
def pass_tiles(tiles, chunk_begin, chunk_end, n_tiled):
    """(first tile, tiles) of a pass [chunk_begin, chunk_end) that go through the tiles: its whole tiles below
    n_tiled, none where they hold fewer than tiles.fewest_tokens (a long row's pass of one or two tiles, whose
    unpacking would cost more than the tiles save)."""
    first_tile = chunk_begin // TILE_TOKENS
    n_pass_tiles = max(0, min(chunk_end, n_tiled) // TILE_TOKENS - first_tile)
    return first_tile, n_pass_tiles if n_pass_tiles * TILE_TOKENS >= tiles.fewest_tokens else 0


@njit(nogil=True, cache=True)
def quantize_activation_rows(x, n_cols, row_begin, row_end, xq, xd, xsum, tiles, n_tokens):
    """quantize_activation_row for rows [row_begin, row_end), and the tiles' copy of those in whole tiles."""
    for t in range(row_begin, row_end):
        quantize_activation_row(x[t], n_cols, xq[t], xd[t], xsum[t])
    tile_activation_rows(tiles, row_begin, row_end, tiled_tokens(tiles, n_tokens, n_cols), n_cols, xq, xd, xsum)


@njit(nogil=True, cache=True, inline="always")
def store_group(out, first, count, g, results, accumulate):
    """out[first + k, 8g + i] (+)= results[k, i] for the `count` tokens of one 8-row group's call."""
    for k in range(count):
        for i in range(8):
            if accumulate:
                out[first + k, 8 * g + i] += results[k, i]
            else:
                out[first + k, 8 * g + i] = results[k, i]


@njit(nogil=True, cache=True, inline="always")
def group_step(t, end):
    """Tokens in the VNNI call at token t of [.., end): 8, then 4, then 1 (a token's numbers never depend
    on which)."""
    return 8 if t + 8 <= end else (4 if t + 4 <= end else 1)


@njit(nogil=True, cache=True)
def matmul_groups(
    packed, qtype, n_cols, xq, xd, xsum, n_tokens, out, group_begin, group_end, accumulate, tmp, tiles, tile_out
):
    """out[t, 8g + i] (+)= row 8g+i · x[t] for groups [group_begin, group_end); tmp: (8, 8) float32, tile_out: a
    row of amx.tile_scratch. Whole tiles of 16 tokens go through `tiles` where they are in use (the same
    numbers). Many tokens go in passes of tokens_per_pass, each over all the groups."""
    n_blocks = n_cols // 32
    stride = group_stride(qtype, n_blocks)
    n_tiled = tiled_tokens(tiles, n_tokens, n_cols)
    chunk = tokens_per_pass(n_cols, tiles.mode != 0)
    for chunk_begin in range(0, n_tokens, chunk):
        chunk_end = min(n_tokens, chunk_begin + chunk)
        first_tile, n_pass_tiles = pass_tiles(tiles, chunk_begin, chunk_end, n_tiled)
        g = group_begin
        while g < group_end:
            n_groups = min(groups_per_tile_call(qtype), group_end - g)
            if n_pass_tiles > 0:
                second = stride if n_groups == 2 else 0
                results = tile_group_products(packed, qtype, g * stride, second, n_blocks, tiles, first_tile,
                                              n_pass_tiles, tile_out)  # fmt: skip
                for i in range(n_pass_tiles):
                    for j in range(n_groups):
                        store_group(out, (first_tile + i) * TILE_TOKENS, TILE_TOKENS, g + j,
                                    results[i, 8 * j : 8 * j + 8].T, accumulate)  # fmt: skip
            for group in range(g, g + n_groups):
                t = chunk_begin + n_pass_tiles * TILE_TOKENS
                while t < chunk_end:
                    step = group_step(t, chunk_end)
                    group_dot(packed, qtype, group * stride, n_blocks, xq, xd, xsum, t, step, tmp)
                    store_group(out, t, step, group, tmp, accumulate)
                    t += step
            g += n_groups


@njit(nogil=True, cache=True, error_model="numpy")
def swiglu_groups(gate, up, qtype_gate, qtype_up, n_cols, xq, xd, xsum, n_tokens, out, up_out, group_begin,
                  group_end, tmp_gate, tmp_up, activation, tiles, tile_out):  # fmt: skip
    """out[t, r] = act(gate_r · x[t]) · (up_r · x[t]) for the rows of groups [group_begin, group_end);
    act is SiLU or the tanh GELU (kernels.gate_sigmoid_argument).

    Whole tiles of 16 tokens go through `tiles` where they are in use (tile_out: two rows of amx.tile_scratch).
    The dot products land first in `out` (gate) and `up_out` (up); the SiLU then runs as one
    contiguous pass over the thread's own columns, where `exp_f32` vectorises (a libm expf per
    element was a sixth of the feed-forward's time at 32 tokens). error_model="numpy": numba's
    default checks every float division for zero to raise ZeroDivisionError, a branch that keeps
    LLVM from vectorising the loop (20x slower); 1 + exp(-g) is never zero.
    """
    n_blocks = n_cols // 32
    stride_gate = group_stride(qtype_gate, n_blocks)
    stride_up = group_stride(qtype_up, n_blocks)
    n_tiled = tiled_tokens(tiles, n_tokens, n_cols)
    chunk = tokens_per_pass(n_cols, tiles.mode != 0)
    for chunk_begin in range(0, n_tokens, chunk):
        chunk_end = min(n_tokens, chunk_begin + chunk)
        first_tile, n_pass_tiles = pass_tiles(tiles, chunk_begin, chunk_end, n_tiled)
        g = group_begin
        while g < group_end:
            n_groups = min(groups_per_tile_call(qtype_gate), groups_per_tile_call(qtype_up), group_end - g)
            if n_pass_tiles > 0:
                gates = tile_group_products(gate, qtype_gate, g * stride_gate, stride_gate if n_groups == 2 else 0,
                                            n_blocks, tiles, first_tile, n_pass_tiles, tile_out[0])  # fmt: skip
                ups = tile_group_products(up, qtype_up, g * stride_up, stride_up if n_groups == 2 else 0, n_blocks,
                                          tiles, first_tile, n_pass_tiles, tile_out[1])  # fmt: skip
                for i in range(n_pass_tiles):
                    first = (first_tile + i) * TILE_TOKENS
                    for j in range(n_groups):
                        store_group(out, first, TILE_TOKENS, g + j, gates[i, 8 * j : 8 * j + 8].T, False)
                        store_group(up_out, first, TILE_TOKENS, g + j, ups[i, 8 * j : 8 * j + 8].T, False)
            for group in range(g, g + n_groups):
                t = chunk_begin + n_pass_tiles * TILE_TOKENS
                while t < chunk_end:
                    step = group_step(t, chunk_end)
                    group_dot(gate, qtype_gate, group * stride_gate, n_blocks, xq, xd, xsum, t, step, tmp_gate)
                    group_dot(up, qtype_up, group * stride_up, n_blocks, xq, xd, xsum, t, step, tmp_up)
                    store_group(out, t, step, group, tmp_gate, False)
                    store_group(up_out, t, step, group, tmp_up, False)
                    t += step
            g += n_groups
    for t in range(n_tokens):
        # sliced, with a loop from 0: numba then proves the index non-negative and LLVM vectorises
        # (a range(begin, end) index keeps a negative-index check in the loop and runs 16x slower)
        gates, ups = out[t, 8 * group_begin : 8 * group_end], up_out[t, 8 * group_begin : 8 * group_end]
        for j in range(gates.shape[0]):
            g_val = gates[j]
            gates[j] = g_val / (np.float32(1.0) + exp_f32(-gate_sigmoid_argument(g_val, activation))) * ups[j]
