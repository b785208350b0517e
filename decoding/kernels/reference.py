"""The reference forward pass: one sequence, plain numpy, float32, written to be read.

This is the oracle every faster kernel is tested against, not a serving path. It follows the
llama architecture step by step (llama2.c's `forward`, for the whole sequence at once), with the
weights dequantized from their stored form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..model.weights import LayerWeights

if TYPE_CHECKING:
    from ..model.model import Model


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: (n, dim) → x / rms(x) · weight, per row."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(mean_square + np.float32(eps))) * weight


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's rotation angles: (n, head_dim / 2) each.

    Pair i of a head rotates by position · theta^(−2i / head_dim); angles are computed in float64
    and rounded once, so positions in the thousands keep their precision.
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (n, heads, head_dim) with ggml's pairing of adjacent dimensions (2i, 2i+1)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q: (n, n_heads, hd); k, v: (n, n_kv_heads, hd) → (n, n_heads, hd), grouped-query, causal."""
    n, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    k = np.repeat(k, group, axis=1)  # each KV head serves `group` consecutive query heads
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(head_dim))
    scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).astype(np.float32)


def _layer(x: np.ndarray, w: LayerWeights, model: Model, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    cfg = model.config
    n = x.shape[0]
    dense = model.dense_weight
    # attention block
    h = rmsnorm(x, w.attn_norm, cfg.rms_eps)
    q = (h @ dense(w.wq).T).reshape(n, cfg.n_heads, cfg.head_dim)
    k = (h @ dense(w.wk).T).reshape(n, cfg.n_kv_heads, cfg.head_dim)
    v = (h @ dense(w.wv).T).reshape(n, cfg.n_kv_heads, cfg.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn = causal_attention(q, k, v).reshape(n, cfg.q_dim)
    x = x + attn @ dense(w.wo).T
    # feed-forward block: SwiGLU
    h = rmsnorm(x, w.ffn_norm, cfg.rms_eps)
    gate = h @ dense(w.w_gate).T
    up = h @ dense(w.w_up).T
    silu = gate / (np.float32(1.0) + np.exp(-gate))
    return x + (silu * up) @ dense(w.w_down).T


def forward_hidden(model: Model, ids: Sequence[int]) -> np.ndarray:
    """Final-normed hidden states, (len(ids), dim) float32."""
    cfg = model.config
    token_ids = np.asarray(ids, dtype=np.int64)
    if token_ids.ndim != 1 or token_ids.size == 0:
        raise ValueError("forward needs a non-empty 1-D sequence of token ids")
    if token_ids.min() < 0 or token_ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
    x = model.weights.token_embedding.dequantize_rows(token_ids)
    cos, sin = rope_tables(np.arange(len(token_ids)), cfg.head_dim, cfg.rope_theta)
    for layer in model.weights.layers:
        x = _layer(x, layer, model, cos, sin)
    return rmsnorm(x, model.weights.output_norm, cfg.rms_eps)


def forward_logits(model: Model, ids: Sequence[int]) -> np.ndarray:
    """Logits for every position: (len(ids), vocab) float32."""
    hidden = forward_hidden(model, ids)
    return (hidden @ model.dense_weight(model.weights.lm_head).T).astype(np.float32)
