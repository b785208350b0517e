"""The encoder step: every layer of a BERT encoder over one step's packed inputs inside one `pool.run`.

    embed (token + position + type) → LayerNorm → for each layer: Q,K,V (+ biases) → attention over the
    input's own tokens (both directions) → output projection + bias + residual → LayerNorm
    → up projection + bias → GELU → down projection + bias + residual → LayerNorm

Inputs are packed back to back (no padding): `seq_starts` says where each begins and `token_seq` which
input a token belongs to, so a token attends exactly to its own input's tokens. The last hidden states
stay in `scratch.x`; pooling and the heads are the caller's (a few rows, decoding.engine.embedding).

The matmuls are the decoder's (`project`): exact float32, or in fast mode int8 activations against
weights repacked for the VNNI kernels — a float checkpoint's matrices are quantized to Q8_0 first, as
llama.cpp serves an F16 embedder's weights through its int8 dot products. Attention, LayerNorm and GELU
run in float32 in both modes. Each value is computed by one thread with the same arithmetic whatever
else shares the step, so an input's vector does not depend on its neighbours (batch invariance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numba import njit
from numba.typed import List

from kvcache.attention import rotate_q8_groups
from kvcache.fastmath import exp_f32
from threadpool import barrier_wait

from ..model.encoder import EncoderConfig, EncoderWeights
from ..model.quant import QType, quantize
from ..model.weights import WeightMatrix
from .amx import TileActivations, tile_activation_rows, tile_activations, tile_scratch
from .fast_kernels import activation_arrays, quantize_activation_row, tiled_tokens
from .forward import _as_bytes, project
from .kernels import dequantize_row, split_range
from .repack import is_packable, packed_type, repack
from .typed_lists import typed_list
from .vnni import GROUP_ROWS, MOST_GROUP_TOKENS

WQ, WK, WV, WO, W_UP, W_DOWN = range(6)
MATRICES_PER_LAYER = 6
_NOT_PACKED = np.zeros(0, dtype=np.uint8)
_FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


def _hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two), symmetric: H·H = I."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def _packed(matrix: WeightMatrix, fast: bool, rotate: bool) -> tuple[np.ndarray, int]:
    """The VNNI layout of a matrix and the type its kernel runs (a float matrix as Q8_0, its columns
    rotated per 32 where `rotate`), or an empty array where the float path serves it."""
    if not fast:
        return _NOT_PACKED, int(matrix.qtype)
    data, qtype = matrix.data, matrix.qtype
    if qtype in _FLOAT_TYPES and matrix.n_cols % 32 == 0:
        w = matrix.dequantize()
        if rotate:
            w = (w.reshape(matrix.n_rows, -1, 32) @ _hadamard(32)).reshape(w.shape)
        data, qtype = quantize(w, QType.Q8_0), QType.Q8_0
    if not is_packable(qtype, matrix.n_rows):
        return _NOT_PACKED, int(matrix.qtype)
    return repack(np.asarray(data), qtype, matrix.n_rows, matrix.n_cols), int(packed_type(qtype))


def rotates_activations(weights: EncoderWeights) -> bool:
    """Whether the fast kernels rotate: where every matrix is float, treadle quantizes them itself and
    first rotates each 32 columns by a Hadamard transform, and the activations the same way before
    they are quantized to int8: dot products are unchanged, but BERT's outlier channels are spread over
    their block instead of setting a scale that rounds the block's other values away (QuaRot's idea;
    measured on all-MiniLM-L6-v2 it halves the fast kernels' distance to the exact ones). Matrices
    stored quantized cannot be rotated without a second rounding: their models run unrotated."""
    return all(m.qtype in _FLOAT_TYPES and m.n_cols % 32 == 0 for layer in weights.layers for m in layer.matrices())


class EncoderArrays(NamedTuple):
    """Every weight the step reads but the layers' matrices."""

    qtypes: np.ndarray  # (n_layers, 6) int64 storage type of each matrix
    packed_qtypes: np.ndarray  # (n_layers, 6) int64 the type whose int8 kernel runs each repacked matrix
    biases: np.ndarray  # (n_layers, 5, dim) float32: Q, K, V, output, down
    up_biases: np.ndarray  # (n_layers, hidden_dim) float32
    norms: np.ndarray  # (n_layers, 4, dim) float32: attention LayerNorm weight, bias; feed-forward's
    embedding: np.ndarray  # (vocab, row_bytes) uint8
    embedding_qtype: int
    position_embedding: np.ndarray  # (max_positions, dim) float32
    type_embedding: np.ndarray  # (n_token_types, dim) float32
    embedding_norm: np.ndarray  # (2, dim) float32
    rotate: bool  # fast mode: activations rotated per 32 before they are quantized, as the weights were


@dataclass(slots=True)
class EncoderKernelWeights:
    matrices: List  # n_layers · 6 arrays (n_rows, row_bytes) uint8, WQ..W_DOWN per layer
    packed: List  # the same matrices repacked for the fast kernels, or empty arrays
    arrays: EncoderArrays

    @classmethod
    def build(cls, cfg: EncoderConfig, weights: EncoderWeights, fast: bool) -> EncoderKernelWeights:
        matrices: list[np.ndarray] = []
        packed: list[np.ndarray] = []
        rotate = fast and rotates_activations(weights)
        qtypes = np.zeros((cfg.n_layers, MATRICES_PER_LAYER), dtype=np.int64)
        packed_qtypes = np.zeros_like(qtypes)
        for i, layer in enumerate(weights.layers):
            for j, m in enumerate(layer.matrices()):
                matrices.append(_as_bytes(m))
                repacked, kernel_type = _packed(m, fast, rotate)
                packed.append(repacked)
                qtypes[i, j], packed_qtypes[i, j] = int(m.qtype), kernel_type
        return cls(typed_list(matrices), typed_list(packed), EncoderArrays(
            qtypes=qtypes, packed_qtypes=packed_qtypes,
            biases=np.ascontiguousarray(np.stack([layer.biases for layer in weights.layers]), dtype=np.float32),
            up_biases=np.ascontiguousarray(np.stack([layer.up_bias for layer in weights.layers]), dtype=np.float32),
            norms=np.ascontiguousarray(np.stack([layer.norms for layer in weights.layers]), dtype=np.float32),
            embedding=_as_bytes(weights.token_embedding), embedding_qtype=int(weights.token_embedding.qtype),
            position_embedding=np.ascontiguousarray(weights.position_embedding, dtype=np.float32),
            type_embedding=np.ascontiguousarray(weights.type_embedding, dtype=np.float32),
            embedding_norm=np.ascontiguousarray(weights.embedding_norm, dtype=np.float32), rotate=rotate,
        ))  # fmt: skip


class EncoderArchitecture(NamedTuple):
    n_heads: int
    head_dim: int
    norm_eps: np.float32
    query_scale: np.float32

    @classmethod
    def of(cls, cfg: EncoderConfig) -> EncoderArchitecture:
        return cls(cfg.n_heads, cfg.head_dim, np.float32(cfg.norm_eps), np.float32(cfg.head_dim**-0.5))


class EncoderInputs(NamedTuple):
    """One step's packed inputs."""

    token_ids: np.ndarray  # (num_tokens,) int64
    type_ids: np.ndarray  # (num_tokens,) int64
    positions: np.ndarray  # (num_tokens,) int64, from 0 in each input
    token_seq: np.ndarray  # (num_tokens,) int64 the input each token belongs to
    seq_starts: np.ndarray  # (num_inputs + 1,) int64 where each input begins


class EncoderScratch(NamedTuple):
    """Scratch for the largest step, allocated once."""

    x: np.ndarray  # (max_tokens, dim) hidden states (the last layer's at the end)
    q: np.ndarray  # (max_tokens, dim)
    k: np.ndarray
    keys_by_dim: np.ndarray  # (n_heads, head_dim, max_tokens) the keys with their bias, transposed per head
    v: np.ndarray
    values_by_dim: np.ndarray  # (n_heads, head_dim, max_tokens) the values likewise
    attn: np.ndarray  # (max_tokens, dim) attention output
    out: np.ndarray  # (max_tokens, dim) a projection's output before the residual
    hidden: np.ndarray  # (max_tokens, hidden_dim)
    scores: np.ndarray  # (n_threads, max_context) float32 one query's attention weights
    row_buffers: np.ndarray  # (n_threads, 2, max(dim, hidden_dim)) dequantized weight rows
    group_out: np.ndarray  # (n_threads, 2, 8, 8) float32
    tiles: TileActivations  # the activations again in AMX tiles' layout (decoding.kernels.amx), or none
    tile_out: np.ndarray  # (n_threads, 2, …) float32: amx.tile_scratch
    xq: np.ndarray  # (max_tokens, max(dim, hidden_dim)) int8 quantized activations (fast mode)
    xd: np.ndarray  # (max_tokens, widest / 32, 2) float32 (decoding.kernels.fast_kernels.activation_arrays)
    xsum: np.ndarray  # (max_tokens, widest / 32, 2) int32

    @classmethod
    def allocate(cls, cfg: EncoderConfig, max_tokens: int, n_threads: int, tile_mode: int = 0) -> EncoderScratch:
        def zeros(*shape: int) -> np.ndarray:
            return np.zeros(shape, dtype=np.float32)

        widest = max(cfg.dim, cfg.hidden_dim)
        xq, xd, xsum = activation_arrays(max_tokens, widest)
        return cls(
            x=zeros(max_tokens, cfg.dim), q=zeros(max_tokens, cfg.dim), k=zeros(max_tokens, cfg.dim),
            keys_by_dim=zeros(cfg.n_heads, cfg.head_dim, max_tokens),
            values_by_dim=zeros(cfg.n_heads, cfg.head_dim, max_tokens),
            v=zeros(max_tokens, cfg.dim), attn=zeros(max_tokens, cfg.dim), out=zeros(max_tokens, cfg.dim),
            hidden=zeros(max_tokens, cfg.hidden_dim), scores=zeros(n_threads, cfg.max_context),
            row_buffers=zeros(n_threads, 2, widest), group_out=zeros(n_threads, 2, MOST_GROUP_TOKENS, GROUP_ROWS),
            tiles=tile_activations(tile_mode, max_tokens, widest),
            tile_out=tile_scratch(n_threads, tile_mode, widest, max_tokens),
            xq=xq, xd=xd, xsum=xsum,
        )  # fmt: skip


@njit(nogil=True, cache=True)
def layernorm_row(x, weight, bias, eps, out):
    """out = (x − mean) / sqrt(var + eps) · weight + bias, the statistics accumulated in float64."""
    n = x.shape[0]
    total = 0.0
    for j in range(n):
        total += x[j]
    mean = total / n
    squares = 0.0
    for j in range(n):
        centred = x[j] - mean
        squares += centred * centred
    inverse = 1.0 / math.sqrt(squares / n + eps)
    for j in range(n):
        out[j] = np.float32((x[j] - mean) * inverse) * weight[j] + bias[j]


# erf(x) as an odd rational function of x on [-4, 4] (±1 beyond in float32): Eigen's float erf, within
# 5e-7 of the true value; unlike libm's erf it vectorises, and GELU runs on every hidden value of a step.
_ERF_NUMERATOR = tuple(np.float32(c) for c in (
    -1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, -5.69250639462346e-05,
    -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10))  # x, x^3, ..., x^13
_ERF_DENOMINATOR = tuple(np.float32(c) for c in (
    -1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03, -2.13374055278905e-04,
    -1.45660718464996e-05))  # 1, x^2, ..., x^8
_SQRT_HALF = np.float32(np.sqrt(0.5))


@njit(nogil=True, cache=True, inline="always")
def erf(x):
    # comparisons rather than min/max, and numpy's error model in the caller: both keep the loop vectorised
    x = x if x < np.float32(4.0) else np.float32(4.0)
    x = x if x > np.float32(-4.0) else np.float32(-4.0)
    x2 = x * x
    a = _ERF_NUMERATOR
    p = (((((a[6] * x2 + a[5]) * x2 + a[4]) * x2 + a[3]) * x2 + a[2]) * x2 + a[1]) * x2 + a[0]
    b = _ERF_DENOMINATOR
    q = (((b[4] * x2 + b[3]) * x2 + b[2]) * x2 + b[1]) * x2 + b[0]
    return x * p / q


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract", "nsz"})
def gelu_row(row, bias):
    """row = GELU(row + bias): BERT's x · Φ(x) with the error function (not the tanh approximation)."""
    for j in range(row.shape[0]):
        value = row[j] + bias[j]
        row[j] = np.float32(0.5) * value * (np.float32(1.0) + erf(value * _SQRT_HALF))


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract", "nsz"})
def attend_row(t, q, keys_by_dim, values_by_dim, out, begin, end, n_heads, head_dim, scale, scores):
    """out[t] = each head's softmax(q[t]·k[j] · scale) · v[j] over the input's tokens j in [begin, end).

    Keys and values are read transposed (`[h, d, j]`), so every product runs along the input's tokens:
    q·k is one multiply-add of a whole row of keys per dimension, p·v one dot product per dimension.
    Sums may be reordered to vectorise them; the order is the compiled loop's, set by the input's length
    alone, so a query's numbers depend only on its own input."""
    n = end - begin
    s = scores[:n]
    for h in range(n_heads):
        base = h * head_dim
        s[:] = 0.0
        for d in range(head_dim):
            qd = q[t, base + d] * scale
            keys = keys_by_dim[h, d, begin:end]
            for j in range(n):
                s[j] += qd * keys[j]
        top = s.max()
        for j in range(n):
            s[j] = exp_f32(s[j] - top)
        inverse = np.float32(1.0) / s.sum()
        for d in range(head_dim):
            values = values_by_dim[h, d, begin:end]
            total = np.float32(0.0)
            for j in range(n):
                total += s[j] * values[j]
            out[t, base + d] = total * inverse


@njit(nogil=True, cache=True)
def _quantize(fast, rotate, x, n_cols, t_begin, t_end, xq, xd, xsum, row, tiles, n_tokens):
    """Rows of x to int8 for the fast kernels (and the tiles), through `row` (scratch) rotated where the weights
    are."""
    if fast:
        n_tiled = tiled_tokens(tiles, n_tokens, n_cols)
        for t in range(t_begin, t_end):
            if rotate:
                row[:n_cols] = x[t, :n_cols]
                rotate_q8_groups(row, n_cols)
                quantize_activation_row(row, n_cols, xq[t], xd[t], xsum[t])
            else:
                quantize_activation_row(x[t], n_cols, xq[t], xd[t], xsum[t])
        tile_activation_rows(tiles, t_begin, t_end, n_tiled, n_cols, xq, xd, xsum)


# fmt: off
@njit(nogil=True, cache=True)
def encoder_step(tid, nthreads, barrier, fast, step, matrices, packed, weights, arch, scratch):
    """One step on thread `tid` of `nthreads`: `step` (EncoderInputs) through every layer; the last
    hidden states end in `scratch.x[:num_tokens]`."""
    token_ids, type_ids, positions = step.token_ids, step.type_ids, step.positions
    token_seq, seq_starts = step.token_seq, step.seq_starts
    qtypes, packed_qtypes, biases, up_biases = weights.qtypes, weights.packed_qtypes, weights.biases, weights.up_biases
    norms, embedding_norm, rotate = weights.norms, weights.embedding_norm, weights.rotate
    n_heads, head_dim, eps, scale = arch.n_heads, arch.head_dim, arch.norm_eps, arch.query_scale
    x, q, k, v, attn = scratch.x, scratch.q, scratch.k, scratch.v, scratch.attn
    out, hidden, keys_by_dim, values_by_dim = scratch.out, scratch.hidden, scratch.keys_by_dim, scratch.values_by_dim
    xq, xd, xsum = scratch.xq, scratch.xd, scratch.xsum
    buf, tmp, scores = scratch.row_buffers[tid], scratch.group_out[tid], scratch.scores[tid]
    tiles, tile_out = scratch.tiles, scratch.tile_out[tid]
    n_tokens = token_ids.shape[0]
    n_layers = qtypes.shape[0]
    dim = x.shape[1]
    hidden_dim = hidden.shape[1]
    t_begin, t_end = split_range(n_tokens, tid, nthreads)

    for t in range(t_begin, t_end):  # embeddings → LayerNorm
        dequantize_row(weights.embedding[token_ids[t]], weights.embedding_qtype, dim, out[t])
        for j in range(dim):
            out[t, j] += weights.position_embedding[positions[t], j] + weights.type_embedding[type_ids[t], j]
        layernorm_row(out[t], embedding_norm[0], embedding_norm[1], eps, x[t])
    _quantize(fast, rotate, x, dim, t_begin, t_end, xq, xd, xsum, buf[1], tiles, n_tokens)
    barrier_wait(barrier, tid)

    for layer in range(n_layers):
        w = layer * 6
        project(fast, matrices[w], packed[w], qtypes[layer, 0], packed_qtypes[layer, 0], dim, dim, x, xq, xd, xsum,
                n_tokens, q, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        project(fast, matrices[w + 1], packed[w + 1], qtypes[layer, 1], packed_qtypes[layer, 1], dim, dim, x, xq,
                xd, xsum, n_tokens, k, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        project(fast, matrices[w + 2], packed[w + 2], qtypes[layer, 2], packed_qtypes[layer, 2], dim, dim, x, xq,
                xd, xsum, n_tokens, v, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        barrier_wait(barrier, tid)
        bias = biases[layer]
        for t in range(t_begin, t_end):
            for j in range(dim):
                q[t, j] += bias[0, j]
        for h in range(n_heads):  # keys and values stored transposed for the attention below, tokens
            for d in range(head_dim):  # innermost: the writes run along a row (8x faster than scattered)
                c = h * head_dim + d
                key_bias, value_bias = bias[1, c], bias[2, c]
                keys, values = keys_by_dim[h, d], values_by_dim[h, d]
                for t in range(t_begin, t_end):
                    keys[t] = k[t, c] + key_bias
                    values[t] = v[t, c] + value_bias
        barrier_wait(barrier, tid)

        for t in range(t_begin, t_end):  # every token attends to its own input, both directions
            s = token_seq[t]
            attend_row(t, q, keys_by_dim, values_by_dim, attn, seq_starts[s], seq_starts[s + 1], n_heads, head_dim,
                       scale, scores)
        _quantize(fast, rotate, attn, dim, t_begin, t_end, xq, xd, xsum, buf[1], tiles, n_tokens)
        barrier_wait(barrier, tid)

        project(fast, matrices[w + 3], packed[w + 3], qtypes[layer, 3], packed_qtypes[layer, 3], dim, dim, attn, xq,
                xd, xsum, n_tokens, out, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        barrier_wait(barrier, tid)
        for t in range(t_begin, t_end):  # + bias + residual → LayerNorm
            for j in range(dim):
                out[t, j] += bias[3, j] + x[t, j]
            layernorm_row(out[t], norms[layer, 0], norms[layer, 1], eps, x[t])
        _quantize(fast, rotate, x, dim, t_begin, t_end, xq, xd, xsum, buf[1], tiles, n_tokens)
        barrier_wait(barrier, tid)

        project(fast, matrices[w + 4], packed[w + 4], qtypes[layer, 4], packed_qtypes[layer, 4], hidden_dim, dim, x,
                xq, xd, xsum, n_tokens, hidden, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        barrier_wait(barrier, tid)
        for t in range(t_begin, t_end):
            gelu_row(hidden[t], up_biases[layer])
        _quantize(fast, rotate, hidden, hidden_dim, t_begin, t_end, xq, xd, xsum, buf[1], tiles, n_tokens)
        barrier_wait(barrier, tid)

        project(fast, matrices[w + 5], packed[w + 5], qtypes[layer, 5], packed_qtypes[layer, 5], dim, hidden_dim,
                hidden, xq, xd, xsum, n_tokens, out, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        barrier_wait(barrier, tid)
        for t in range(t_begin, t_end):
            for j in range(dim):
                out[t, j] += bias[4, j] + x[t, j]
            layernorm_row(out[t], norms[layer, 2], norms[layer, 3], eps, x[t])
        _quantize(fast, rotate, x, dim, t_begin, t_end, xq, xd, xsum, buf[1], tiles, n_tokens)
        barrier_wait(barrier, tid)
# fmt: on
