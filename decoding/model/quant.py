"""GGML storage types and their block formats, with numpy dequantization for the reference path.

Block layouts follow ggml (ggml-common.h); every quantized block holds 32 weights of one row:

- Q8_0: 34 bytes = fp16 scale `d`, 32 × int8 `q`;          w = d·q
- Q4_0: 18 bytes = fp16 `d`, 16 bytes of nibbles;          w = d·(nibble − 8)
- Q4_1: 20 bytes = fp16 `d`, fp16 min `m`, 16 bytes;       w = d·nibble + m

In Q4 blocks byte j holds weight j in its low nibble and weight j+16 in its high nibble.
"""

from __future__ import annotations

import enum

import numpy as np

QK = 32  # weights per quantized block


class QType(enum.IntEnum):
    """Storage types kept as stored in memory; values are ggml's type ids."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30


# bytes per 32-weight block, for the block-quantized types
BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


def row_bytes(qtype: QType, n_cols: int) -> int:
    """Bytes one row of `n_cols` weights occupies in storage type `qtype`."""
    if qtype in BLOCK_BYTES:
        return n_cols // QK * BLOCK_BYTES[qtype]
    return n_cols * {QType.F32: 4, QType.F16: 2, QType.BF16: 2}[qtype]


def _blocks(data: np.ndarray, qtype: QType) -> np.ndarray:
    """View (rows, row_bytes) uint8 storage as (rows, n_blocks, block_bytes)."""
    rows = data.shape[0]
    return data.reshape(rows, -1, BLOCK_BYTES[qtype])


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
