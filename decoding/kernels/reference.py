"""The reference forward pass: one sequence, plain numpy, float32, written to be read.

This is the oracle every faster kernel is tested against, not a serving path. It follows the
architecture step by step (llama2.c's `forward`, for the whole sequence at once, with each
ModelConfig switch where it acts), with the weights dequantized from their stored form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..model.weights import LayerWeights

if TYPE_CHECKING:
    from ..model.encoder import EncoderModel
    from ..model.model import Model


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: (n, dim) → x / rms(x) · weight, per row."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(mean_square + np.float32(eps))) * weight


def rope_tables(positions: np.ndarray, head_dim: int, theta: float, freq_factors: Sequence[float] = (),
                linear_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """cos and sin of each position's rotation angles: (n, head_dim / 2) each.

    Pair i of a head rotates by (position / linear_factor) · theta^(−2i / head_dim) / freq_factors[i];
    angles are computed in float64 and rounded once, so positions in the thousands keep their precision.
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(freq_factors):
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = (positions.astype(np.float64)[:, None] / linear_factor) * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool = False) -> np.ndarray:
    """x: (n, heads, head_dim), rotating pairs (i, i + head_dim/2) if `neox` (Hugging Face's
    rotate-half), else ggml's adjacent pairs (2i, 2i+1)."""
    half = x.shape[-1] // 2
    first, second = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    if neox:
        out[..., :half], out[..., half:] = first * c - second * s, first * s + second * c
    else:
        out[..., 0::2], out[..., 1::2] = first * c - second * s, first * s + second * c
    return out


def causal_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int = 0
) -> np.ndarray:
    """q: (n, n_heads, hd); k, v: (n, n_kv_heads, hd) → (n, n_heads, hd), grouped-query, causal;
    with a window, position p sees only positions p - window + 1 .. p."""
    n = q.shape[0]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)  # each KV head serves `group` consecutive query heads
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * np.float32(scale)
    visible = np.tril(np.ones((n, n), dtype=bool))
    if window:
        visible &= ~np.tril(np.ones((n, n), dtype=bool), -window)
    scores = np.where(visible[None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).astype(np.float32)


def gate_activation(gate: np.ndarray, activation: str) -> np.ndarray:
    if activation == "gelu_tanh":
        inner = np.float32(np.sqrt(2.0 / np.pi)) * (gate + np.float32(0.044715) * gate**3)
        return np.float32(0.5) * gate * (np.float32(1.0) + np.tanh(inner))
    return gate / (np.float32(1.0) + np.exp(-gate))


def _layer(x: np.ndarray, w: LayerWeights, model: Model, index: int, positions: np.ndarray) -> np.ndarray:
    cfg = model.config
    n = x.shape[0]
    dense = model.dense_weight
    # attention block
    h = rmsnorm(x, w.attn_norm, cfg.rms_eps)
    q, k, v = h @ dense(w.wq).T, h @ dense(w.wk).T, h @ dense(w.wv).T
    if cfg.qkv_bias:
        q, k, v = q + w.q_bias, k + w.k_bias, v + w.v_bias
    q = q.reshape(n, cfg.n_heads, cfg.head_dim)
    k = k.reshape(n, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = rmsnorm(q, w.q_norm, cfg.rms_eps), rmsnorm(k, w.k_norm, cfg.rms_eps)
    theta, linear_factor = cfg.layer_rope(index)
    cos, sin = rope_tables(positions, cfg.head_dim, theta, cfg.rope_freq_factors, linear_factor)
    q, k = apply_rope(q, cos, sin, cfg.rope_neox), apply_rope(k, cos, sin, cfg.rope_neox)
    attn = causal_attention(q, k, v, cfg.query_scale, cfg.layer_window(index)).reshape(n, cfg.q_dim)
    out = attn @ dense(w.wo).T
    x = x + (rmsnorm(out, w.post_attn_norm, cfg.rms_eps) if cfg.post_norms else out)
    # feed-forward block: a gated linear unit (SwiGLU, GeGLU), or a routed mixture of them
    h = rmsnorm(x, w.ffn_norm, cfg.rms_eps)
    out = _experts(h, w, model) if cfg.is_moe else _gated_unit(h, dense(w.w_gate), dense(w.w_up), dense(w.w_down),
                                                                cfg.activation)  # fmt: skip
    return x + (rmsnorm(out, w.post_ffn_norm, cfg.rms_eps) if cfg.post_norms else out)


def _gated_unit(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, activation: str) -> np.ndarray:
    return (gate_activation(h @ gate.T, activation) * (h @ up.T)) @ down.T


def route(h: np.ndarray, router: np.ndarray, n_used: int, normalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's chosen experts, best first, and their weights: the softmax over every expert's score,
    its `n_used` largest (the lower index first on a tie), renormalised to sum to one if `normalise`."""
    scores = h @ router.T
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :n_used]
    weights = np.take_along_axis(probs, chosen, axis=1)
    if normalise:
        weights /= weights.sum(axis=1, keepdims=True)
    return chosen, weights.astype(np.float32)


def _experts(h: np.ndarray, w: LayerWeights, model: Model) -> np.ndarray:
    """A mixture of experts: each row through its chosen experts' gated units, summed by weight."""
    cfg = model.config
    e, rows = cfg.n_experts, cfg.hidden_dim
    gate = model.dense_weight(w.w_gate).reshape(e, rows, cfg.dim)
    up = model.dense_weight(w.w_up).reshape(e, rows, cfg.dim)
    down = model.dense_weight(w.w_down).reshape(e, cfg.dim, rows)
    chosen, weights = route(h, w.router, cfg.n_experts_used, cfg.norm_topk_prob)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for expert, weight in zip(chosen[t], weights[t], strict=True):
            out[t] += weight * _gated_unit(h[t : t + 1], gate[expert], up[expert], down[expert], cfg.activation)[0]
    return out


def forward_hidden(model: Model, ids: Sequence[int]) -> np.ndarray:
    """Final-normed hidden states, (len(ids), dim) float32."""
    cfg = model.config
    token_ids = np.asarray(ids, dtype=np.int64)
    if token_ids.ndim != 1 or token_ids.size == 0:
        raise ValueError("forward needs a non-empty 1-D sequence of token ids")
    if token_ids.min() < 0 or token_ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
    x = model.weights.token_embedding.dequantize_rows(token_ids) * np.float32(cfg.embedding_scale)
    positions = np.arange(len(token_ids))
    for index, layer in enumerate(model.weights.layers):
        x = _layer(x, layer, model, index, positions)
    return rmsnorm(x, model.weights.output_norm, cfg.rms_eps)


def forward_logits(model: Model, ids: Sequence[int]) -> np.ndarray:
    """Logits for every position: (len(ids), vocab) float32."""
    hidden = forward_hidden(model, ids)
    return (hidden @ model.dense_weight(model.weights.lm_head).T).astype(np.float32)


def layernorm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float64)
    variance = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (((x - mean) / np.sqrt(variance + eps)) * weight + bias).astype(np.float32)


def encoder_hidden(model: EncoderModel, ids: Sequence[int], type_ids: Sequence[int] | None = None) -> np.ndarray:
    """A BERT encoder's last hidden states (n, dim) for one input: post-norm layers, attention over
    every token of the input in both directions, GELU with the error function."""
    from math import erf  # noqa: PLC0415 - only the encoder's reference needs it

    cfg, w = model.config, model.weights
    ids = np.asarray(ids, dtype=np.int64)
    types = np.zeros_like(ids) if type_ids is None else np.asarray(type_ids, dtype=np.int64)
    n, heads, hd = len(ids), cfg.n_heads, cfg.head_dim
    x = w.token_embedding.dequantize_rows(ids) + w.position_embedding[:n] + w.type_embedding[types]
    x = layernorm(x, w.embedding_norm[0], w.embedding_norm[1], cfg.norm_eps)
    vectorised_erf = np.vectorize(erf, otypes=[np.float64])
    for layer in w.layers:
        projections = zip((layer.wq, layer.wk, layer.wv), layer.biases[:3], strict=True)
        q, k, v = (x @ m.dequantize().T + b for m, b in projections)
        q, k, v = (a.reshape(n, heads, hd).transpose(1, 0, 2) for a in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) * np.float32(hd**-0.5)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        attn = attn.transpose(1, 0, 2).reshape(n, cfg.dim)
        x = layernorm(x + attn @ layer.wo.dequantize().T + layer.biases[3], layer.norms[0], layer.norms[1],
                      cfg.norm_eps)  # fmt: skip
        h = x @ layer.w_up.dequantize().T + layer.up_bias
        h = (0.5 * h * (1.0 + vectorised_erf(h / np.sqrt(2.0)))).astype(np.float32)
        x = layernorm(x + h @ layer.w_down.dequantize().T + layer.biases[4], layer.norms[2], layer.norms[3],
                      cfg.norm_eps)  # fmt: skip
    return x.astype(np.float32)
