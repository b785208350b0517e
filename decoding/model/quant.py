"""GGML storage types and their block formats, with numpy dequantization for the reference path.

Block layouts follow ggml (ggml-common.h). The legacy types hold 32 weights of one row a block:

- Q8_0: 34 bytes = fp16 scale `d`, 32 × int8 `q`;          w = d·q
- Q4_0: 18 bytes = fp16 `d`, 16 bytes of nibbles;          w = d·(nibble − 8)
- Q4_1: 20 bytes = fp16 `d`, fp16 min `m`, 16 bytes;       w = d·nibble + m
- Q5_0: 22 bytes = fp16 `d`, 4 bytes of fifth bits, 16 bytes of nibbles;   w = d·(q5 − 16)
- Q5_1: 24 bytes = fp16 `d`, fp16 `m`, 4 bytes of fifth bits, 16 bytes;   w = d·q5 + m

In Q4 and Q5 blocks byte j holds weight j in its low nibble and weight j+16 in its high nibble; in
Q5, bit j of the little-endian 32-bit `qh` is weight j's fifth (high) bit.

The K types hold 256 weights a *super-block*, split into sub-blocks with their own scale (and min)
packed in a few bits, scaled in turn by the super-block's fp16 `d` (and `dmin`):

- Q2_K:  84 bytes = 16 × (4-bit scale | 4-bit min << 4), 64 bytes of 2-bit q, fp16 d, fp16 dmin;
         16 sub-blocks of 16, w = d·scale·q − dmin·min
- Q3_K: 110 bytes = 32 bytes of high bits, 64 bytes of 2-bit q, 12 bytes of 16 packed 6-bit
         scales, fp16 d; w = d·(scale − 32)·(q − 4·(1 − high bit))
- Q4_K: 144 bytes = fp16 d, fp16 dmin, 12 bytes of 8 packed 6-bit scales and mins, 128 bytes of
         nibbles; 8 sub-blocks of 32, w = d·scale·q − dmin·min
- Q5_K: 176 bytes = as Q4_K, with 32 bytes of fifth bits before the nibbles
- Q6_K: 210 bytes = 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 × int8 scale, fp16 d;
         16 sub-blocks of 16, w = d·scale·(q6 − 32)

The K types' bit positions (which byte and shift hold weight i) are spelled out in their
dequantizers below, each with the loop of ggml's dequantize_row_* it follows. The float operations
run in ggml's order, so the results are bit-identical to ggml's (and to the `gguf` package's).
"""

from __future__ import annotations

import enum
from functools import partial

import numpy as np

QK = 32  # weights per quantized block


class QType(enum.IntEnum):
    """Storage types kept as stored in memory and run by the kernels; values are ggml's type ids.
    (A GGUF tensor of any other ggml type is dequantized to F32 when loaded.)"""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


QK_K = 256  # weights per K-type super-block

# bytes per 32-weight block of the types the int8 (fast) kernels repack and run as stored
BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
# (weights, bytes) of one block of every block-quantized type
BLOCK_SHAPES = {
    **{qtype: (QK, size) for qtype, size in BLOCK_BYTES.items()},
    QType.Q5_0: (QK, 22), QType.Q5_1: (QK, 24),
    QType.Q2_K: (QK_K, 84), QType.Q3_K: (QK_K, 110), QType.Q4_K: (QK_K, 144), QType.Q5_K: (QK_K, 176),
    QType.Q6_K: (QK_K, 210),
}


# byte offsets of each block type's fp16 fields: the scale d, and the min m (or dmin) where there is one
FP16_FIELDS = {
    QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}
K_TYPES = tuple(qtype for qtype, (weights, _) in BLOCK_SHAPES.items() if weights == QK_K)


def row_bytes(qtype: QType, n_cols: int) -> int:
    """Bytes one row of `n_cols` weights occupies in storage type `qtype`."""
    if qtype in BLOCK_SHAPES:
        weights, size = BLOCK_SHAPES[qtype]
        return n_cols // weights * size
    return n_cols * {QType.F32: 4, QType.F16: 2, QType.BF16: 2}[qtype]


def _blocks(data: np.ndarray, qtype: QType) -> np.ndarray:
    """View (rows, row_bytes) uint8 storage as (rows, n_blocks, block_bytes)."""
    rows = data.shape[0]
    return data.reshape(rows, -1, BLOCK_SHAPES[qtype][1])


def _fp16_field(blocks: np.ndarray, byte_offset: int) -> np.ndarray:
    """The fp16 scalar stored at `byte_offset` of each block, as float32 with a trailing axis of 1."""
    raw = np.ascontiguousarray(blocks[..., byte_offset : byte_offset + 2])
    return raw.view(np.float16).astype(np.float32)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """(…, 16) bytes → (…, 32) values 0..15 in weight order: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32: bf16 is the top half of an fp32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def dequantize(data: np.ndarray, qtype: QType, n_cols: int) -> np.ndarray:
    """Stored weights of shape (rows, …) → float32 (rows, n_cols)."""
    rows = data.shape[0]
    if qtype == QType.F32:
        return np.asarray(data, dtype=np.float32).reshape(rows, n_cols)
    if qtype == QType.F16:
        return np.asarray(data).view(np.float16).astype(np.float32).reshape(rows, n_cols)
    if qtype == QType.BF16:
        return bf16_to_f32(np.asarray(data).view(np.uint16)).reshape(rows, n_cols)
    blocks = _blocks(np.asarray(data), qtype)
    if qtype in _SUPER_BLOCK_DEQUANTIZERS:  # (n, bytes) super-blocks in, (n, 256) weights out
        return _SUPER_BLOCK_DEQUANTIZERS[qtype](blocks.reshape(-1, blocks.shape[-1])).reshape(rows, n_cols)
    if qtype in (QType.Q5_0, QType.Q5_1):
        return _dequantize_q5(blocks, qtype).reshape(rows, n_cols)
    d = _fp16_field(blocks, 0)
    if qtype == QType.Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
        out = d * q
    elif qtype == QType.Q4_0:
        out = d * (_unpack_nibbles(blocks[..., 2:]) - 8.0)
    elif qtype == QType.Q4_1:
        m = _fp16_field(blocks, 2)
        out = d * _unpack_nibbles(blocks[..., 4:]) + m
    else:  # pragma: no cover - QType is closed
        raise ValueError(f"no dequantizer for {qtype!r}")
    return out.reshape(rows, n_cols)


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """(…, 4) bytes of a little-endian uint32 → (…, 32) bits: bit j is weight j's fifth bit."""
    return np.unpackbits(qh_bytes, axis=-1, bitorder="little")


def _dequantize_q5(blocks: np.ndarray, qtype: QType) -> np.ndarray:
    """Q5_0 and Q5_1 (ggml's dequantize_row_q5_0 / _q5_1): a nibble plus a fifth bit per weight."""
    d = _fp16_field(blocks, 0)
    header = 2 if qtype == QType.Q5_0 else 4
    high = _fifth_bits(blocks[..., header : header + 4]).astype(np.uint8) << 4
    q = (np.concatenate([blocks[..., header + 4 :] & 0x0F, blocks[..., header + 4 :] >> 4], axis=-1) | high)
    if qtype == QType.Q5_0:
        return d * (q.astype(np.float32) - 16.0)
    return d * q.astype(np.float32) + _fp16_field(blocks, 2)


def _fp16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at `offset` of each super-block, as a (n, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).astype(np.float32)


def _dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    # for each half h of 128, shift j, part p: sub-block 8h + 2j + p holds weights 128h + 32j + 16p + l,
    # whose 2 bits are bits 2j..2j+1 of qs[32h + 16p + l]; y = (d·scale)·q − (dmin·min)
    scales = blocks[:, 0:16]
    qs = blocks[:, 16:80].reshape(-1, 2, 1, 2, 16)  # (n, half, ·, part, l)
    d, dmin = _fp16_at(blocks, 80), _fp16_at(blocks, 82)
    q = (qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)) & 3  # (n, half, shift, part, l)
    dl = (d * (scales & 0x0F).astype(np.float32)).reshape(-1, 2, 4, 2, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(-1, 2, 4, 2, 1)
    return (dl * q.astype(np.float32) - ml).reshape(-1, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """12 bytes → 16 signed 6-bit scales: the low 4 bits of scale i are nibble i // 8 of byte i % 8,
    the high 2 bits are bits 2·(i // 4) of byte 8 + i % 4 (ggml's kmask1/kmask2 unpacking)."""
    i = np.arange(16)
    low = (packed[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (packed[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 0x03
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def _dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    # as Q2_K's order; the high bit of weight 128h + 32j + 16p + l is bit 4h + j of hmask[16p + l],
    # and a clear high bit subtracts 4; y = (d·(scale − 32))·(q − 4·(1 − high))
    hmask = blocks[:, 0:32].reshape(-1, 1, 1, 2, 16)
    qs = blocks[:, 32:96].reshape(-1, 2, 1, 2, 16)
    scales = _q3_k_scales(blocks[:, 96:108]).astype(np.float32)
    d = _fp16_at(blocks, 108)
    shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1, 1)
    q = ((qs >> (2 * shifts)) & 3).astype(np.int8)
    bit = (np.arange(2, dtype=np.uint8).reshape(1, 2, 1, 1, 1) * 4 + shifts)
    high = (hmask >> bit) & 1
    q = q - np.where(high == 1, 0, 4).astype(np.int8)
    dl = (d * scales).reshape(-1, 2, 4, 2, 1)
    return (dl * q.astype(np.float32)).reshape(-1, QK_K)


def k4_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes → 8 six-bit scales and 8 mins (ggml's get_scale_min_k4): sub-blocks 0-3 keep theirs
    in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 keep the low 4 bits in a
    nibble of bytes 8-11 and the high 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    low_scales, low_mins = packed[:, 0:4] & 63, packed[:, 4:8] & 63
    high_scales = (packed[:, 8:12] & 0x0F) | ((packed[:, 0:4] >> 6) << 4)
    high_mins = (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)
    scales = np.concatenate([low_scales, high_scales], axis=-1).astype(np.float32)
    mins = np.concatenate([low_mins, high_mins], axis=-1).astype(np.float32)
    return scales, mins


def _dequantize_q4_k(blocks: np.ndarray, fifth_bits: bool = False) -> np.ndarray:
    # for each 64 weights g: sub-block 2g from the low nibbles of qs[32g : 32g + 32], sub-block 2g + 1
    # from their high nibbles; Q5_K adds 16 where bit 2g (low) or 2g + 1 (high) of qh[l] is set;
    # y = (d·scale)·q − (dmin·min)
    d, dmin = _fp16_at(blocks, 0), _fp16_at(blocks, 2)
    scales, mins = k4_scales_and_mins(blocks[:, 4:16])
    start = 48 if fifth_bits else 16
    qs = blocks[:, start : start + 128].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # (n, g, nibble, l): sub-block 2g + nibble
    if fifth_bits:
        qh = blocks[:, 16:48].reshape(-1, 1, 1, 32)
        bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
        q = q + ((qh >> bit) & 1) * np.uint8(16)
    dl = (d * scales).reshape(-1, 4, 2, 1)
    ml = (dmin * mins).reshape(-1, 4, 2, 1)
    return (dl * q.astype(np.float32) - ml).reshape(-1, QK_K)


def dequantize_q6_k_codes(blocks: np.ndarray) -> np.ndarray:
    """(n, 210) Q6_K super-blocks → (n, 256) int8 q6 − 32, in weight order.

    For each half h of 128 and l < 32: weights 128h + l + 32k (k = 0..3) take the low nibble of
    ql[64h + l] (k = 0), of ql[64h + 32 + l] (k = 1), their high nibbles (k = 2, 3), and bits
    2k..2k+1 of qh[32h + l]."""
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # (n, half, 0 or 32, l)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, half, k, l)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(-1, QK_K)


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # weight i's scale is sub-block i // 16's int8 (sub-block 8h + 2k + l // 16 in ggml's loop);
    # y = (d·scale)·(q6 − 32)
    q = dequantize_q6_k_codes(blocks).reshape(-1, 16, 16)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _fp16_at(blocks, 208)
    dl = (d * scales).reshape(-1, 16, 1)
    return (dl * q.astype(np.float32)).reshape(-1, QK_K)


_SUPER_BLOCK_DEQUANTIZERS = {
    QType.Q2_K: _dequantize_q2_k,
    QType.Q3_K: _dequantize_q3_k,
    QType.Q4_K: _dequantize_q4_k,
    QType.Q5_K: partial(_dequantize_q4_k, fifth_bits=True),
    QType.Q6_K: _dequantize_q6_k,
}


def quantize(weights: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 (rows, cols) → storage in `qtype` (rows, row_bytes) uint8, or the float array itself.

    Used to build small test models and to store Hugging Face float checkpoints; rounding follows
    ggml's reference quantizers (quantize_row_*_ref).
    """
    w = np.asarray(weights, dtype=np.float32)
    rows, cols = w.shape
    if qtype == QType.F32:
        return w.copy()
    if qtype == QType.F16:
        return w.astype(np.float16)
    if qtype == QType.BF16:
        bits = w.view(np.uint32)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)  # round to nearest even
        return (rounded >> 16).astype(np.uint16)
    if cols % QK:
        raise ValueError(f"{qtype.name} needs a multiple of {QK} columns, got {cols}")
    x = w.reshape(rows, cols // QK, QK)
    out = np.zeros((rows, cols // QK, BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == QType.Q8_0:
        amax = np.abs(x).max(axis=-1, keepdims=True)
        d = amax / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.round(x * inv), -128, 127).astype(np.int8)
        out[..., 0:2] = d.astype(np.float16).view(np.uint8)
        out[..., 2:] = q.view(np.uint8)
    elif qtype == QType.Q4_0:
        idx = np.abs(x).argmax(axis=-1)[..., None]
        maxv = np.take_along_axis(x, idx, axis=-1)  # signed value of largest magnitude
        d = maxv / -8.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.trunc(x * inv + 8.5), 0, 15).astype(np.uint8)
        out[..., 0:2] = d.astype(np.float16).view(np.uint8)
        out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    elif qtype == QType.Q4_1:
        lo = x.min(axis=-1, keepdims=True)
        hi = x.max(axis=-1, keepdims=True)
        d = (hi - lo) / 15.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.trunc((x - lo) * inv + 0.5), 0, 15).astype(np.uint8)
        out[..., 0:2] = d.astype(np.float16).view(np.uint8)
        out[..., 2:4] = lo.astype(np.float16).view(np.uint8)
        out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, -1)
