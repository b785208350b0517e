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
Q5_0, Q5_1 = int(QType.Q5_0), int(QType.Q5_1)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (int(QType.Q2_K), int(QType.Q3_K), int(QType.Q4_K), int(QType.Q5_K),
                                int(QType.Q6_K))

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
    elif qtype == Q5_0 or qtype == Q5_1:
        _dequantize_q5_row(row, qtype == Q5_1, n_cols, out)
    elif qtype == Q2_K:
        _dequantize_q2_k_row(row, n_cols, out)
    elif qtype == Q3_K:
        _dequantize_q3_k_row(row, n_cols, out)
    elif qtype == Q4_K or qtype == Q5_K:
        _dequantize_q4_k_row(row, qtype == Q5_K, n_cols, out)
    elif qtype == Q6_K:
        _dequantize_q6_k_row(row, n_cols, out)
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


# The row dequantizers of the 5-bit and K types follow ggml's dequantize_row_* loop for loop, float
# operations in its order, so they equal decoding.model.quant.dequantize bit for bit (tested).


@njit(nogil=True, cache=True)
def _dequantize_q5_row(row, has_min, n_cols, out):
    size = 24 if has_min else 22
    header = 4 if has_min else 2
    for b in range(n_cols // 32):
        base = b * size
        d = load_f16(row, base)
        m = load_f16(row, base + 2) if has_min else np.float32(0.0)
        qh = (np.int64(row[base + header]) | (np.int64(row[base + header + 1]) << 8)
              | (np.int64(row[base + header + 2]) << 16) | (np.int64(row[base + header + 3]) << 24))
        for j in range(16):
            byte = np.int64(row[base + header + 4 + j])
            x0 = np.int32((byte & 15) | (((qh >> j) & 1) << 4))
            x1 = np.int32((byte >> 4) | (((qh >> (j + 16)) & 1) << 4))
            if has_min:
                out[b * 32 + j] = np.float32(x0) * d + m
                out[b * 32 + j + 16] = np.float32(x1) * d + m
            else:
                out[b * 32 + j] = np.float32(x0 - 16) * d
                out[b * 32 + j + 16] = np.float32(x1 - 16) * d


@njit(nogil=True, cache=True)
def _dequantize_q2_k_row(row, n_cols, out):
    for b in range(n_cols // 256):
        base = b * 84
        d = load_f16(row, base + 80)
        dmin = load_f16(row, base + 82)
        y = b * 256
        sub = 0
        for half in range(2):
            q = base + 16 + 32 * half
            for j in range(4):
                for part in range(2):
                    sc = np.int64(row[base + sub])
                    dl = d * np.float32(sc & 15)
                    ml = dmin * np.float32(sc >> 4)
                    for i in range(16):
                        out[y] = dl * np.float32((np.int64(row[q + 16 * part + i]) >> (2 * j)) & 3) - ml
                        y += 1
                    sub += 1


@njit(nogil=True, cache=True)
def _dequantize_q3_k_row(row, n_cols, out):
    for b in range(n_cols // 256):
        base = b * 110
        d = load_f16(row, base + 108)
        y = b * 256
        sub = 0
        for half in range(2):
            q = base + 32 + 32 * half
            for j in range(4):
                mask = 1 << (4 * half + j)
                for part in range(2):
                    # scale `sub`: low 4 bits in nibble sub // 8 of byte sub % 8, high 2 bits at
                    # 2 * (sub // 4) of byte 8 + sub % 4 (ggml's kmask unpacking)
                    low = (np.int64(row[base + 96 + sub % 8]) >> (4 * (sub // 8))) & 15
                    high = (np.int64(row[base + 104 + sub % 4]) >> (2 * (sub // 4))) & 3
                    dl = d * np.float32(np.int32(low | (high << 4)) - 32)
                    for i in range(16):
                        value = np.int32((np.int64(row[q + 16 * part + i]) >> (2 * j)) & 3)
                        if not np.int64(row[base + 16 * part + i]) & mask:
                            value -= 4
                        out[y] = dl * np.float32(value)
                        y += 1
                    sub += 1


@njit(inline="always", nogil=True, cache=True)
def _k4_scale_min(row, scales, j):
    """Sub-block j's 6-bit scale and min in a Q4_K/Q5_K super-block (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.int64(row[scales + j]) & 63, np.int64(row[scales + j + 4]) & 63
    scale = (np.int64(row[scales + j + 4]) & 15) | ((np.int64(row[scales + j - 4]) >> 6) << 4)
    minimum = (np.int64(row[scales + j + 4]) >> 4) | ((np.int64(row[scales + j]) >> 6) << 4)
    return scale, minimum


@njit(nogil=True, cache=True)
def _dequantize_q4_k_row(row, has_fifth_bits, n_cols, out):
    size = 176 if has_fifth_bits else 144
    for b in range(n_cols // 256):
        base = b * size
        d = load_f16(row, base)
        dmin = load_f16(row, base + 2)
        qs = base + (48 if has_fifth_bits else 16)
        y = b * 256
        for g in range(4):
            for nibble in range(2):
                scale, minimum = _k4_scale_min(row, base + 4, 2 * g + nibble)
                dl = d * np.float32(scale)
                ml = dmin * np.float32(minimum)
                for i in range(32):
                    byte = np.int64(row[qs + 32 * g + i])
                    value = (byte >> 4) if nibble else (byte & 15)
                    if has_fifth_bits and (np.int64(row[base + 16 + i]) >> (2 * g + nibble)) & 1:
                        value += 16
                    out[y] = dl * np.float32(value) - ml
                    y += 1


@njit(nogil=True, cache=True)
def _dequantize_q6_k_row(row, n_cols, out):
    for b in range(n_cols // 256):
        base = b * 210
        d = load_f16(row, base + 208)
        for half in range(2):
            ql = base + 64 * half
            qh = base + 128 + 32 * half
            scales = base + 192 + 8 * half
            y = b * 256 + 128 * half
            for i in range(32):
                high = np.int64(row[qh + i])
                for k in range(4):
                    low = np.int64(row[ql + i + 32 * (k & 1)])
                    nibble = (low >> 4) if k >= 2 else (low & 15)
                    value = np.int32(nibble | (((high >> (2 * k)) & 3) << 4)) - 32
                    scale = np.float32((np.int64(row[scales + i // 16 + 2 * k]) ^ 128) - 128)  # the byte as int8
                    out[y + i + 32 * k] = d * scale * np.float32(value)


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


GATE_SILU, GATE_GELU_TANH = 0, 1  # the gate activation of a gated feed-forward (SwiGLU, GeGLU)
_GELU_TANH_SCALE = np.float32(2.0 * np.sqrt(2.0 / np.pi))


@njit(nogil=True, cache=True, inline="always")
def gate_sigmoid_argument(gate, activation):
    """The gated unit is gate · sigmoid(u) · up, with u = gate for SiLU; for the tanh GELU,
    0.5 · (1 + tanh(z)) = sigmoid(2z) makes u = 2 · sqrt(2/π) · (gate + 0.044715 · gate³)."""
    if activation == GATE_GELU_TANH:
        return _GELU_TANH_SCALE * (gate + np.float32(0.044715) * gate * gate * gate)
    return gate


@njit(nogil=True, cache=True)
def swiglu_rows(w_gate, gate_qtype, w_up, up_qtype, n_cols, x, n_tokens, out, row_begin, row_end, buf_gate, buf_up,
                activation):  # fmt: skip
    """out[t, r] = act(W_gate[r] · x[t]) · (W_up[r] · x[t]): both projections of a row by one thread."""
    for r in range(row_begin, row_end):
        dequantize_row(w_gate[r], gate_qtype, n_cols, buf_gate)
        dequantize_row(w_up[r], up_qtype, n_cols, buf_up)
        for t in range(n_tokens):
            gate = dot(buf_gate, x[t], n_cols)
            up = dot(buf_up, x[t], n_cols)
            out[t, r] = gate / (np.float32(1.0) + np.exp(-gate_sigmoid_argument(gate, activation))) * up


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
def rope_row(vec, n_heads, head_dim, cos, sin, neox):
    """Rotate each head's pairs in place by the position's angles: (i, i + head_dim/2) if `neox`
    (Hugging Face's layout), else adjacent pairs (2i, 2i+1) (ggml's llama files)."""
    half = head_dim // 2
    first_stride, pair_offset = (1, half) if neox else (2, 1)
    for h in range(n_heads):
        base = h * head_dim
        for i in range(half):
            j = base + first_stride * i
            a = vec[j]
            b = vec[j + pair_offset]
            vec[j] = a * cos[i] - b * sin[i]
            vec[j + pair_offset] = a * sin[i] + b * cos[i]


@njit(nogil=True, cache=True, fastmath=_DOT_MATH)
def head_rmsnorm_row(vec, n_heads, head_dim, weight, eps):
    """RMSNorm of each head's slice of a query or key row, in place, with one weight for all heads."""
    for h in range(n_heads):
        head = vec[h * head_dim : (h + 1) * head_dim]
        rmsnorm_row(head, weight, eps, head)
