"""Numba building blocks of the model step, each named after its math.

Every function takes `tid`/`nthreads` (or a row range) and computes its own slice; the caller puts a
barrier between phases. Each output value is computed by exactly one thread by the same arithmetic
whatever the thread count or batch size, which is what makes a sequence's numbers independent of
its neighbours (batch invariance).

Weights arrive as uint8 rows in their stored form (see decoding.model.quant for the block layouts) plus a
type code, and are dequantized one row at a time into a per-thread float32 buffer, then used for every
token of the step: each weight row crosses the memory bus once per step, whatever the batch size.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..model.quant import QType
from .numeric import bf16_bits_to_f32, f16_bits_to_f32, load_f16

F32, F16, BF16 = int(QType.F32), int(QType.F16), int(QType.BF16)
Q4_0, Q4_1, Q8_0 = int(QType.Q4_0), int(QType.Q4_1), int(QType.Q8_0)

# Dot products may be reassociated so LLVM can vectorise them; the order is fixed by the compiled
# loop, not by the batch, so results stay batch-invariant.
_DOT_MATH = {"reassoc", "contract", "nsz"}


@njit(nogil=True, cache=True)
def split_range(n, tid, nthreads):
    """Contiguous [begin, end) share of n items for thread tid."""
    return n * tid // nthreads, n * (tid + 1) // nthreads


@njit(nogil=True, cache=True)
def dequantize_row(row, qtype, n_cols, out):
    """One stored row (uint8) → out[:n_cols] float32."""
    if qtype == Q4_1:
        for b in range(n_cols // 32):
            base = b * 20
            d = load_f16(row, base)
            m = load_f16(row, base + 2)
            for j in range(16):
                byte = row[base + 4 + j]
                out[b * 32 + j] = d * np.float32(byte & 15) + m
                out[b * 32 + j + 16] = d * np.float32(byte >> 4) + m
    elif qtype == Q4_0:
        for b in range(n_cols // 32):
            base = b * 18
            d = load_f16(row, base)
            for j in range(16):
                byte = row[base + 2 + j]
                out[b * 32 + j] = d * (np.float32(byte & 15) - np.float32(8.0))
                out[b * 32 + j + 16] = d * (np.float32(byte >> 4) - np.float32(8.0))
    elif qtype == Q8_0:
        for b in range(n_cols // 32):
            base = b * 34
            d = load_f16(row, base)
            for j in range(32):
                q = (np.int32(row[base + 2 + j]) ^ 128) - 128  # reinterpret the byte as int8
                out[b * 32 + j] = d * np.float32(q)
    elif qtype == F32:
        values = row.view(np.float32)
        for j in range(n_cols):
            out[j] = values[j]
    elif qtype == F16:
        for j in range(n_cols):
            out[j] = f16_bits_to_f32(row[2 * j] | (row[2 * j + 1] << 8))
    elif qtype == BF16:
        for j in range(n_cols):
            out[j] = bf16_bits_to_f32(row[2 * j] | (row[2 * j + 1] << 8))


@njit(nogil=True, cache=True, fastmath=_DOT_MATH)
def dot(a, b, n):
    acc = np.float32(0.0)
    for j in range(n):
        acc += a[j] * b[j]
    return acc


@njit(nogil=True, cache=True)
def matmul_rows(weight, qtype, n_cols, x, n_tokens, out, out_offset, row_begin, row_end, accumulate, buf):
    """out[t, out_offset + r] (+)= W[r] · x[t] for r in [row_begin, row_end), every token t < n_tokens.

    weight: (n_rows, row_bytes) uint8; x: (≥n_tokens, ≥n_cols) float32; buf: (≥n_cols,) float32 scratch.
    """
    for r in range(row_begin, row_end):
        dequantize_row(weight[r], qtype, n_cols, buf)
        for t in range(n_tokens):
            value = dot(buf, x[t], n_cols)
            if accumulate:
                out[t, out_offset + r] += value
            else:
                out[t, out_offset + r] = value


@njit(nogil=True, cache=True)
def swiglu_rows(w_gate, gate_qtype, w_up, up_qtype, n_cols, x, n_tokens, out, row_begin, row_end, buf_gate, buf_up):
    """out[t, r] = silu(W_gate[r] · x[t]) · (W_up[r] · x[t]): both projections of a row by one thread."""
    for r in range(row_begin, row_end):
        dequantize_row(w_gate[r], gate_qtype, n_cols, buf_gate)
        dequantize_row(w_up[r], up_qtype, n_cols, buf_up)
        for t in range(n_tokens):
            gate = dot(buf_gate, x[t], n_cols)
            up = dot(buf_up, x[t], n_cols)
            out[t, r] = gate / (np.float32(1.0) + np.exp(-gate)) * up


@njit(nogil=True, cache=True, fastmath=_DOT_MATH)
def rmsnorm_row(x, weight, eps, out):
    n = x.shape[0]
    sum_squares = np.float32(0.0)
    for j in range(n):
        sum_squares += x[j] * x[j]
    scale = np.float32(1.0) / np.sqrt(sum_squares / np.float32(n) + np.float32(eps))
    for j in range(n):
        out[j] = x[j] * scale * weight[j]


@njit(nogil=True, cache=True)
def rope_row(vec, n_heads, head_dim, cos, sin):
    """Rotate each head's adjacent pairs (2i, 2i+1) in place by the position's angles (ggml's order)."""
    half = head_dim // 2
    for h in range(n_heads):
        base = h * head_dim
        for i in range(half):
            a = vec[base + 2 * i]
            b = vec[base + 2 * i + 1]
            vec[base + 2 * i] = a * cos[i] - b * sin[i]
            vec[base + 2 * i + 1] = a * sin[i] + b * cos[i]
