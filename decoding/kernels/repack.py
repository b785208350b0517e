"""Repack ggml blocks at load into the layout the VNNI kernels stream (decoding.kernels.vnni).

Rows are taken in groups of 8; for each 32-weight block the group's bytes are contiguous:

    Q4_0 / Q4_1: 4 steps × 8 rows × 4 bytes of nibbles (128 B), 8 fp16 scales (16 B)[, 8 fp16 mins (16 B)]
    Q5_0 / Q5_1: the nibbles as Q4_0 (128 B), 4 steps × 8 rows × 1 byte of fifth bits (32 B), 8 fp16
                 scales[, 8 fp16 mins]
    Q6_K:        the low four bits of each q6 (offset 32) as Q4_0's nibbles (128 B), 4 steps × 16 bytes of
                 their top two bits (64 B), 16 fp16 scales d·scale, row r's for its weights 0..15 and
                 16..31 (32 B): 7 bits a weight instead of 6.56
    Q8_0:        4 steps × 8 rows × 8 bytes, each weight + 128 as an unsigned byte (256 B), 8 fp16 scales
    Q4_K:        per 256-weight super-block, the 8 rows' fp16 d and dmin (32 B), then per block Q4_0's
                 nibbles (128 B), 8 one-byte sub-block scales and 8 one-byte mins: 4.625 bits a weight

Step s of a row holds its weights 4s..4s+3 and 16+4s..16+4s+3: in a Q4 byte the low nibble is weight j
and the high nibble weight j+16, so nibble bytes need no reshuffling; Q8_0 bytes are put in the same
order so that one activation layout (`ACTIVATION_ORDER`) serves every type. A repacked Q4_0..Q8_0
matrix has exactly as many bytes as the original (a Q4_K one 3% more, a Q6_K one 7%); streaming 8 rows
at a time keeps the hardware prefetcher on one sequential stream per thread.
"""

from __future__ import annotations

import numpy as np

from ..model.quant import BLOCK_SHAPES, QK, QType, dequantize_q6_k_codes, k4_scales_and_mins
from .vnni import BLOCK_STRIDE, GROUP_ROWS

PACKABLE = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q6_K, QType.Q4_K)
# Types the int8 kernels run in the form of another: a Q5_K sub-block of 32 is w = (d·scale)·q − dmin·min,
# the form of a Q5_1 block (w = D·q + M), so it is converted at load, D and M rounded to fp16 (a relative
# 2^-11 at most, far inside the int8 activations' error), and runs on the Q5_1 kernel. (Q4_K has a form
# of its own, which keeps the 6-bit scales: 4.625 bits a weight where the Q4_1 form took 5.)
PACKED_AS = {QType.Q5_K: QType.Q5_1}
_GROUPS_PER_SLICE = 256  # 2048 rows: a few MB of temporaries at a time
# activation byte i of a block holds weight ACTIVATION_ORDER[i]: step s = [4s..4s+3, 16+4s..16+4s+3]
ACTIVATION_ORDER = np.array([4 * s + k for s in range(4) for k in (0, 1, 2, 3, 16, 17, 18, 19)], dtype=np.int64)


def packed_type(qtype: QType) -> QType:
    """The type whose int8 kernel runs a matrix stored as `qtype`."""
    return PACKED_AS.get(qtype, qtype)


def is_packable(qtype: QType, n_rows: int) -> bool:
    return packed_type(qtype) in PACKABLE and n_rows % GROUP_ROWS == 0


def packed_nbytes(qtype: QType, n_rows: int, n_cols: int) -> int:
    """Bytes of the repacked form of an (n_rows, n_cols) matrix stored as `qtype`; 0 if not packable."""
    if not is_packable(qtype, n_rows):
        return 0
    return n_rows // GROUP_ROWS * (n_cols // QK) * BLOCK_STRIDE[packed_type(qtype)]


def repack(data: np.ndarray, qtype: QType, n_rows: int, n_cols: int) -> np.ndarray:
    """(n_rows, row_bytes) ggml blocks → flat uint8 stream of n_rows / 8 groups, same size.

    Groups are independent and laid out one after another, so they are repacked a slice at a time:
    the numpy temporaries of a whole LM head (int16 widening, gathers, transposes) would otherwise
    raise the process's peak memory by several times the matrix at start.
    """
    if not is_packable(qtype, n_rows):
        raise ValueError(f"{qtype.name} with {n_rows} rows cannot be repacked")
    data = np.asarray(data, dtype=np.uint8).reshape(n_rows, -1)
    target = packed_type(qtype)
    n_groups = n_rows // GROUP_ROWS
    group_bytes = n_cols // QK * BLOCK_STRIDE[target]
    out = np.empty(n_groups * group_bytes, dtype=np.uint8)
    for first in range(0, n_groups, _GROUPS_PER_SLICE):
        last = min(first + _GROUPS_PER_SLICE, n_groups)
        rows = data[first * GROUP_ROWS : last * GROUP_ROWS]
        if qtype == QType.Q4_K:
            out[first * group_bytes : last * group_bytes] = _repack_q4_k_groups(rows, last - first, n_cols)
            continue
        if qtype == QType.Q5_K:
            rows = q5_k_as_q5_1(rows, n_cols)
        out[first * group_bytes : last * group_bytes] = _repack_groups(rows, target, last - first, n_cols)
    return out


def q5_k_as_q5_1(data: np.ndarray, n_cols: int) -> np.ndarray:
    """(rows, Q5_K row bytes) → (rows, Q5_1 row bytes): each 32-weight sub-block as a Q5_1 block with
    D = fp16(d·scale), M = fp16(−dmin·min) and the same 5-bit q (decoding.model.quant has the layouts)."""
    rows = data.shape[0]
    blocks = data.reshape(-1, 176)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = k4_scales_and_mins(blocks[:, 4:16])
    qs = blocks[:, 48:176].reshape(-1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # sub-block 2g + nibble
    with np.errstate(over="ignore", invalid="ignore"):
        scale, minimum = (d * scales).astype(np.float16), (-(dmin * mins)).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
        raise ValueError("a K sub-block's scale or min does not fit in fp16: it stays on the float32 path")
    out = np.empty((blocks.shape[0], 8, 24), dtype=np.uint8)
    out[..., 0:2] = scale[..., None].view(np.uint8)
    out[..., 2:4] = minimum[..., None].view(np.uint8)
    out[..., 8:24] = q[..., :16] | (q[..., 16:] << 4)
    # sub-block 2g + nibble's fifth bits are bit 2g + nibble of qh[l], l < 32
    qh = blocks[:, 16:48]
    bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, sub-block, l)
    out[..., 4:8] = np.packbits(bits, axis=-1, bitorder="little")
    return out.reshape(rows, n_cols // 32 * 24)


def _repack_q4_k_groups(data: np.ndarray, n_groups: int, n_cols: int) -> np.ndarray:
    """Q4_K rows → the int8 kernels' Q4_K form: per (group, super-block), the rows' d and dmin, then per
    32 weights the sub-block's nibbles as Q4_0's and each row's 6-bit scale and min as a byte each."""
    n_blocks = n_cols // QK
    n_super = n_blocks // GROUP_ROWS
    super_blocks = data.reshape(-1, 144)
    scales, mins = k4_scales_and_mins(super_blocks[:, 4:16])  # (rows · n_super, 8 sub-blocks)
    qs = super_blocks[:, 16:144].reshape(-1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # sub-block 2g + nibble
    nibble_bytes = q[..., :16] | (q[..., 16:] << 4)  # Q4_0's layout: byte j = weights j, j+16
    nibbles = nibble_bytes.reshape(n_groups, GROUP_ROWS, n_blocks, 4, 4).transpose(0, 2, 3, 1, 4)

    def per_row_byte(values: np.ndarray) -> np.ndarray:  # (rows · n_super, 8) → (groups, blocks, 8 rows)
        return values.astype(np.uint8).reshape(n_groups, GROUP_ROWS, n_blocks).transpose(0, 2, 1)

    blocks = np.concatenate([nibbles.reshape(n_groups, n_blocks, 128), per_row_byte(scales), per_row_byte(mins)],
                            axis=-1)  # fmt: skip
    headers = super_blocks[:, 0:4].reshape(n_groups, GROUP_ROWS, n_super, 4).transpose(0, 2, 1, 3)
    return np.concatenate([headers.reshape(n_groups, n_super, 32), blocks.reshape(n_groups, n_super, -1)],
                          axis=-1).reshape(-1)  # fmt: skip


def _repack_q6_k_groups(data: np.ndarray, n_groups: int, n_cols: int) -> np.ndarray:
    """Q6_K rows → the int8 kernels' Q6_K form: per (group, 32 weights), the low four bits of each q6
    as Q4_0's nibbles, the top two bits (`_high_bit_planes`), then each row's two fp16 scales d·scale
    (one per 16 weights, rounded from float32)."""
    n_blocks = n_cols // QK
    rows = data.shape[0]
    super_blocks = data.reshape(-1, 210)
    d = super_blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scales16 = super_blocks[:, 192:208].view(np.int8).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        half_scales = (d * scales16).astype(np.float16)  # (n, 16): sub-block i holds weights 16i..16i+15
    if not np.isfinite(half_scales).all():
        raise ValueError("a Q6_K sub-block's scale does not fit in fp16: it stays on the float32 path")
    q6 = (dequantize_q6_k_codes(super_blocks) + 32).astype(np.uint8).reshape(rows, n_blocks, 32)  # 0..63
    nibble_bytes = (q6[..., :16] & 15) | ((q6[..., 16:] & 15) << 4)  # Q4_0's layout: byte j = weights j, j+16
    nibbles = nibble_bytes.reshape(n_groups, GROUP_ROWS, n_blocks, 4, 4).transpose(0, 2, 3, 1, 4)
    high = (q6[..., ACTIVATION_ORDER] >> 4).reshape(n_groups, GROUP_ROWS, n_blocks, 4, 8)  # step order
    scales = half_scales.reshape(n_groups, GROUP_ROWS, n_blocks, 2).transpose(0, 2, 1, 3)
    parts = [nibbles.reshape(n_groups, n_blocks, 128), _high_bit_planes(high),
             scales.reshape(n_groups, n_blocks, 16).copy().view(np.uint8)]  # fmt: skip
    return np.concatenate(parts, axis=-1).reshape(-1)


def _high_bit_planes(high: np.ndarray) -> np.ndarray:
    """(groups, 8 rows, blocks, 4 steps, 8) two-bit values → (groups, blocks, 64) bytes: per step 16
    bytes, byte p holding in bits 2j, 2j+1 the value of the kernel's weight byte i = 16j + p (row i // 8,
    byte i % 8 of its step), the order vnni._high_bits_vector unpacks."""
    n_groups, _, n_blocks, _, _ = high.shape
    per_step = high.transpose(0, 2, 3, 1, 4).reshape(n_groups, n_blocks, 4, 4, 16)  # (..., step, j, p)
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
    packed = np.bitwise_or.reduce(per_step << shifts, axis=-2).astype(np.uint8)  # (..., step, p)
    return packed.reshape(n_groups, n_blocks, 64)


def _repack_groups(data: np.ndarray, qtype: QType, n_groups: int, n_cols: int) -> np.ndarray:
    if qtype == QType.Q6_K:
        return _repack_q6_k_groups(data, n_groups, n_cols)
    n_blocks = n_cols // QK
    blocks = data.reshape(n_groups, GROUP_ROWS, n_blocks, BLOCK_SHAPES[qtype][1])
    scales = blocks[..., 0:2].transpose(0, 2, 1, 3).reshape(n_groups, n_blocks, 16)
    if qtype == QType.Q8_0:
        weights = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        weights = weights[..., ACTIVATION_ORDER]  # (g, r, b, 32) in step order
        steps = weights.reshape(n_groups, GROUP_ROWS, n_blocks, 4, 8).transpose(0, 2, 3, 1, 4)
        parts = [steps.reshape(n_groups, n_blocks, 256), scales]
    elif qtype in (QType.Q5_0, QType.Q5_1):
        high = 2 if qtype == QType.Q5_0 else 4  # where qh starts; the nibbles follow it
        nibbles = blocks[..., high + 4 : high + 20].reshape(n_groups, GROUP_ROWS, n_blocks, 4, 4)
        # bit k of (step s, row r) is the fifth bit of the weight in byte k of the row's step: the
        # weights in ACTIVATION_ORDER
        fifth = np.unpackbits(blocks[..., high : high + 4], axis=-1, bitorder="little")[..., ACTIVATION_ORDER]
        step_bits = np.packbits(fifth.reshape(n_groups, GROUP_ROWS, n_blocks, 4, 8), axis=-1, bitorder="little")
        parts = [nibbles.transpose(0, 2, 3, 1, 4).reshape(n_groups, n_blocks, 128),
                 step_bits[..., 0].transpose(0, 2, 3, 1).reshape(n_groups, n_blocks, 32), scales]
        if qtype == QType.Q5_1:
            parts.append(blocks[..., 2:4].transpose(0, 2, 1, 3).reshape(n_groups, n_blocks, 16))
    else:
        first = 4 if qtype == QType.Q4_1 else 2
        nibbles = blocks[..., first : first + 16].reshape(n_groups, GROUP_ROWS, n_blocks, 4, 4)
        parts = [nibbles.transpose(0, 2, 3, 1, 4).reshape(n_groups, n_blocks, 128), scales]
        if qtype == QType.Q4_1:
            parts.append(blocks[..., 2:4].transpose(0, 2, 1, 3).reshape(n_groups, n_blocks, 16))
    return np.concatenate(parts, axis=-1).reshape(-1)
