"""The model step: every layer of one engine step inside one `pool.run`, a barrier between phases.

    embed (· scale) → for each layer: RMSNorm → Q,K,V (+ biases) → (head RMSNorm) → RoPE,
    write K/V to the paged cache → paged attention (windowed on sliding layers)
    → output projection (→ RMSNorm) + residual → RMSNorm → gate·up (SiLU or GELU gate)
    → down projection (→ RMSNorm) + residual → final RMSNorm of the rows that sample → LM head

In a mixture of experts the gated feed-forward is routed: each token's chosen experts, grouped by
expert so each one's weights are read once a step (decoding.kernels.experts).

The parenthesised phases are the architecture switches of `ModelConfig` (qwen2's biases, qwen3's
and gemma3's head norms, gemma3's post-norms, embedding scale and GELU, per-layer windows and
rotary bases): one step body for every architecture, each switch a branch on a scalar.

Three lifetimes, as in llama2.c: `ModelConfig` (shape, and the `Architecture` switches the step reads),
`KernelWeights` (read-only, stored form), `StepScratch` (sized once for the largest step; nothing is
allocated per step). `model_step` takes them as named structures — namedtuples, which numba passes by
field at no cost — plus one step's `StepInputs`; a field is added in one place and read by name. The
matrices travel apart as typed lists (a typed list inside a tuple slows numba's dispatch ~20x).

Two kernel modes, one step body. `exact`: float32 activations, each weight row dequantized and dotted
in float32 (logits within 1e-3 of the reference). `fast`: activations quantized to int8 per 32-block,
VNNI integer dot products over weights repacked at load (decoding.kernels.fast_kernels; llama.cpp-like
numerics). Both are batch-invariant: a token's numbers never depend on which rows share its step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from numba import njit
from numba.typed import List

from kvcache.attention import attention_scratch, paged_attention_rows, rotate_q8_groups, write_kv_rows
from kvcache.fastmath import is_int8
from threadpool import barrier_wait

from ..model.config import ModelConfig
from ..model.token_rows import TokenRows
from ..model.weights import LayerWeights, ModelWeights, WeightMatrix, release_file_maps, release_mapped_pages
from . import weight_cache
from .amx import (
    EMULATED,
    FEWEST_TILED_TOKENS,
    HARDWARE,
    TileActivations,
    tile_activations,
    tile_scratch,
    tiles_from,
)
from .amx_probe import tile_support
from .experts import expert_feed_forward, route_tokens
from .fast_kernels import activation_arrays, matmul_groups, quantize_activation_rows, swiglu_groups, tokens_per_pass
from .kernels import (
    GATE_GELU_TANH,
    GATE_SILU,
    dequantize_row,
    head_rmsnorm_row,
    matmul_rows,
    rmsnorm_row,
    rope_row,
    split_range,
    swiglu_rows,
)
from .phases import (
    ATTENTION,
    ATTENTION_NORM,
    COMBINE_EXPERTS,
    DOWN_PROJECTION,
    EMBED,
    FFN_NORM,
    FINAL_NORM,
    GATE_UP,
    KV_WRITE,
    LM_HEAD,
    OUTPUT_PROJECTION,
    POST_NORMS,
    QKV,
    QUANTIZE_ATTENTION,
    QUANTIZE_HIDDEN,
    ROPE,
    cycle_counter,
    lap,
    no_profile,
)
from .reference import rope_tables
from .repack import is_packable, packed_nbytes, packed_type, repack
from .typed_lists import typed_list
from .vnni import GROUP_ROWS, MOST_GROUP_TOKENS

log = logging.getLogger(__name__)

# order of a layer's matrices in KernelWeights.matrices
WQ, WK, WV, WO, W_GATE, W_UP, W_DOWN = range(7)
MATRICES_PER_LAYER = 7
# fast: int8 activations, VNNI (AVX2 elsewhere) and AMX tiles where granted; fast-no-amx: the same without
# tiles (the same numbers: decoding.kernels.amx); exact: float32 activations
KERNEL_MODES = ("fast", "fast-no-amx", "exact")


def int8_kernels(kernels: str) -> bool:
    """Whether a --kernels mode runs the int8 (`fast`) kernels over repacked weights."""
    return kernels != "exact"


def tile_mode(kernels: str) -> int:
    """The tiles' mode for a --kernels mode (decoding.kernels.amx): HARDWARE where `fast` and AMX is granted, the
    emulation where TREADLE_AMX=emulate (to test the tiles' path on any CPU), else 0; the choice is logged."""
    if kernels != "fast":
        return 0
    if os.environ.get("TREADLE_AMX") == "emulate":
        log.info("AMX tiles: emulated in vector IR (TREADLE_AMX=emulate; slower, for tests)")
        return EMULATED
    support = tile_support()
    log.info("AMX tiles: %s", f"used for steps of {FEWEST_TILED_TOKENS} tokens or more" if support.granted
             else f"not used ({support.reason})")  # fmt: skip
    return HARDWARE if support.granted else 0
_NOT_PACKED = np.zeros(0, dtype=np.uint8)


def _packed(matrix: WeightMatrix, fast: bool, parts: int = 1) -> np.ndarray:
    """The VNNI layout of a matrix, or an empty array where the float path must serve it. `parts`:
    experts stacked in it, each of whose rows must pack on its own (whole groups of 8).

    Steps then read only the repacked copy, so the stored matrix's file pages are released as soon
    as it is made: the process holds the model once, not twice (see `release_mapped_pages`).
    """
    if fast and is_packable(matrix.qtype, matrix.n_rows // parts):
        try:
            packed = repack(matrix.data, matrix.qtype, matrix.n_rows, matrix.n_cols)
        except ValueError:  # a conversion the values do not allow (Q5_K scales beyond fp16)
            return _NOT_PACKED
        release_mapped_pages(matrix.data)
        return packed
    return _NOT_PACKED


def _layer_matrices(layer: LayerWeights) -> tuple[WeightMatrix, ...]:
    return (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down)


def _step_matrices(weights: ModelWeights) -> list[WeightMatrix]:
    """The matrices a step multiplies: every layer's (WQ..W_DOWN order), then the LM head."""
    return [m for layer in weights.layers for m in _layer_matrices(layer)] + [weights.lm_head]


def _all_packed(weights: ModelWeights, fast: bool, cache: Path | None, n_experts: int) -> list[np.ndarray]:
    """Every layer's matrices (WQ..W_DOWN order) then the LM head, repacked (or empty where not)."""
    all_matrices = _step_matrices(weights)
    parts = [max(n_experts, 1) if i % MATRICES_PER_LAYER >= W_GATE else 1
             for i in range(len(all_matrices) - 1)] + [1]  # fmt: skip
    if not fast or cache is None:
        return [_packed(m, fast, n) for m, n in zip(all_matrices, parts, strict=True)]
    sizes = [packed_nbytes(m.qtype, m.n_rows // n, m.n_cols) * n for m, n in zip(all_matrices, parts, strict=True)]
    mapped = weight_cache.load(cache, sizes)
    if mapped is not None:
        log.info("repacked weights mapped from %s", cache)
        return mapped
    started = time.perf_counter()
    made = weight_cache.build(cache, sizes, lambda i: _packed(all_matrices[i], fast, parts[i]))
    log.info("weights repacked in %.1f s and kept in %s", time.perf_counter() - started, cache)
    return made


def resident_weight_bytes(weights: ModelWeights, fast: bool) -> int:
    """Bytes of weights a step reads, all resident while serving: each matrix in the form the kernels
    run (repacked, or as stored where the float path serves it). Embedding rows are read a few at a
    time and not counted."""
    return sum((fast and packed_nbytes(m.qtype, m.n_rows, m.n_cols)) or m.nbytes for m in _step_matrices(weights))


def bytes_read_per_token(cfg: ModelConfig, weights: ModelWeights, fast: bool) -> int:
    """Bytes of weights one token's decode step reads, in the form the kernels run: every matrix and
    the LM head of a dense model; in a mixture of experts, the attention, routers and head and the
    chosen n_experts_used of every projection's n_experts (`resident_weight_bytes` counts them all)."""
    total = resident_weight_bytes(weights, fast)
    if not cfg.is_moe:
        return total
    for layer in weights.layers:
        experts = sum((fast and packed_nbytes(m.qtype, m.n_rows, m.n_cols)) or m.nbytes
                      for m in (layer.w_gate, layer.w_up, layer.w_down))  # fmt: skip
        total += experts * cfg.n_experts_used // cfg.n_experts - experts + layer.router.nbytes
    return total


def _as_bytes(matrix: WeightMatrix) -> np.ndarray:
    """The stored rows as a plain (n_rows, row_bytes) uint8 array (a view: no copy of the weights)."""
    data = np.asarray(matrix.data)
    return np.ascontiguousarray(data).view(np.uint8).reshape(matrix.n_rows, -1)


class WeightArrays(NamedTuple):
    """Every weight the step reads but the layers' matrices."""

    qtypes: np.ndarray  # (n_layers, 7) int64 storage type of each matrix
    packed_qtypes: np.ndarray  # (n_layers, 7) int64 the type whose int8 kernel runs each repacked matrix
    norms: np.ndarray  # (n_layers, 4, dim) float32: attention, feed-forward, post-attention, post-FFN
    biases: np.ndarray  # (n_layers, q_dim + 2 kv_dim) float32: Q, K, V biases back to back (zeros if none)
    head_norms: np.ndarray  # (n_layers, 2, head_dim) float32: query and key head norms (ones if none)
    layer_windows: np.ndarray  # (n_layers,) int64: keys each layer attends to, 0 = all
    layer_ropes: np.ndarray  # (n_layers,) int64: which rotary table each layer uses
    embedding_qtype: int  # the token embedding's type: its rows come with each step (StepInputs.embedding_rows)
    lm_head: np.ndarray  # (vocab, row_bytes) uint8
    lm_head_qtype: int
    lm_head_packed: np.ndarray  # flat uint8, or empty
    lm_head_packed_qtype: int
    output_norm: np.ndarray  # (dim,) float32
    rope_cos: np.ndarray  # (n_tables, max_context, head_dim / 2) float32
    rope_sin: np.ndarray  # (n_tables, max_context, head_dim / 2) float32
    routers: np.ndarray  # (n_layers, n_experts, dim) float32 each expert's score row; n_experts = 0 if dense
    key_centres: np.ndarray  # (n_layers, kv_dim) float32 c: an int8 cache stores k − c (kvcache.key_centres)


# rotary rows filled at a time as positions first reach them (256 KiB a table at a head of 128)
ROPE_ROWS_AT_ONCE = 1024


@dataclass(slots=True)
class KernelWeights:
    matrices: List  # n_layers · 7 arrays (n_rows, row_bytes) uint8, in WQ..W_DOWN order per layer
    packed: List  # the same matrices repacked for the fast kernels (flat uint8), or empty arrays
    arrays: WeightArrays
    token_rows: TokenRows  # the token embedding's rows for each step
    ropes: list[tuple[float, float]]  # (theta, linear factor) of each rotary table
    rope_freq_factors: tuple[float, ...]
    rope_rows: int = 0  # rows of the rotary tables filled so far

    def cover_positions(self, positions: np.ndarray) -> None:
        """Fill the rotary tables' rows up to the furthest of `positions` before a step reads them. The
        tables span the model's whole context (64 MiB at Llama 3.1's 131,072 positions) but stay unbacked
        memory until a sequence reaches a row; each row is the same whenever it is computed."""
        end = int(positions.max()) + 1 if positions.shape[0] else 0
        if end <= self.rope_rows:
            return
        cos_tables, sin_tables = self.arrays.rope_cos, self.arrays.rope_sin
        if end > cos_tables.shape[1]:
            raise ValueError(f"position {end - 1} is past the model's {cos_tables.shape[1]} positions")
        end = min(cos_tables.shape[1], -(-end // ROPE_ROWS_AT_ONCE) * ROPE_ROWS_AT_ONCE)
        rows = np.arange(self.rope_rows, end)
        head_dim = 2 * cos_tables.shape[2]
        for i, (theta, factor) in enumerate(self.ropes):
            cos_tables[i, rows], sin_tables[i, rows] = rope_tables(rows, head_dim, theta, self.rope_freq_factors,
                                                                   factor)  # fmt: skip
        self.rope_rows = end

    @classmethod
    def build(cls, cfg: ModelConfig, weights: ModelWeights, fast: bool, cache: Path | None = None) -> KernelWeights:
        """`cache`: a weight-cache file (decoding.kernels.weight_cache) to map the repacked matrices
        from, or to write them into as they are made where it is missing; None repacks in memory."""
        matrices: list[np.ndarray] = []
        packed: list[np.ndarray] = []
        qtypes = np.zeros((cfg.n_layers, MATRICES_PER_LAYER), dtype=np.int64)
        packed_qtypes = np.zeros_like(qtypes)
        norms = np.zeros((cfg.n_layers, 4, cfg.dim), dtype=np.float32)
        biases = np.zeros((cfg.n_layers, cfg.q_dim + 2 * cfg.kv_dim), dtype=np.float32)
        head_norms = np.ones((cfg.n_layers, 2, cfg.head_dim), dtype=np.float32)
        routers = np.zeros((cfg.n_layers, cfg.n_experts, cfg.dim), dtype=np.float32)
        all_packed = _all_packed(weights, fast, cache, cfg.n_experts)
        for i, layer in enumerate(weights.layers):
            for j, m in enumerate(_layer_matrices(layer)):
                matrices.append(_as_bytes(m))
                packed.append(all_packed[i * MATRICES_PER_LAYER + j])
                qtypes[i, j] = int(m.qtype)
                packed_qtypes[i, j] = int(packed_type(m.qtype))
            norms[i, 0], norms[i, 1] = layer.attn_norm, layer.ffn_norm
            if cfg.post_norms:
                norms[i, 2], norms[i, 3] = layer.post_attn_norm, layer.post_ffn_norm
            if cfg.qkv_bias:
                biases[i] = np.concatenate([layer.q_bias, layer.k_bias, layer.v_bias])
            if cfg.qk_norm:
                head_norms[i, 0], head_norms[i, 1] = layer.q_norm, layer.k_norm
            if cfg.is_moe:
                routers[i] = layer.router
        ropes = sorted({cfg.layer_rope(i) for i in range(cfg.n_layers)})
        rope_shape = (len(ropes), cfg.max_context, cfg.head_dim // 2)  # zeros: filled by cover_positions
        # a copy: a read-only view (an F32 tensor of a mapped file) is another numba type, and the step
        # would compile again for it
        output_norm = np.array(weights.output_norm, dtype=np.float32)
        if fast:  # every tensor read from the file is copied or repacked by now
            release_file_maps([m.data for m in _step_matrices(weights)]
                              + [weights.token_embedding.data, weights.output_norm])
        return cls(typed_list(matrices), typed_list(packed), WeightArrays(
            qtypes=qtypes, packed_qtypes=packed_qtypes, norms=norms, biases=biases, head_norms=head_norms,
            layer_windows=np.array([cfg.layer_window(i) for i in range(cfg.n_layers)], dtype=np.int64),
            layer_ropes=np.array([ropes.index(cfg.layer_rope(i)) for i in range(cfg.n_layers)], dtype=np.int64),
            embedding_qtype=int(weights.token_embedding.qtype),
            lm_head=_as_bytes(weights.lm_head), lm_head_qtype=int(weights.lm_head.qtype),
            lm_head_packed=all_packed[-1], lm_head_packed_qtype=int(packed_type(weights.lm_head.qtype)),
            output_norm=output_norm,
            rope_cos=np.zeros(rope_shape, dtype=np.float32), rope_sin=np.zeros(rope_shape, dtype=np.float32),
            routers=routers, key_centres=np.zeros((cfg.n_layers, cfg.kv_dim), dtype=np.float32),
        ), token_rows=TokenRows(_as_bytes(weights.token_embedding)), ropes=ropes,
            rope_freq_factors=tuple(cfg.rope_freq_factors))  # fmt: skip


class Architecture(NamedTuple):
    """The shape and the switches the step branches on (one step body for every architecture)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: np.float32
    qkv_bias: bool
    qk_norm: bool
    post_norms: bool
    activation: int  # GATE_SILU or GATE_GELU_TANH
    embedding_scale: np.float32
    query_scale: np.float32
    rope_neox: bool
    n_experts: int  # 0: a dense feed-forward
    n_experts_used: int
    norm_topk_prob: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> Architecture:
        return cls(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                   rms_eps=np.float32(cfg.rms_eps), qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
                   post_norms=cfg.post_norms,
                   activation=GATE_GELU_TANH if cfg.activation == "gelu_tanh" else GATE_SILU,
                   embedding_scale=np.float32(cfg.embedding_scale), query_scale=np.float32(cfg.query_scale),
                   rope_neox=cfg.rope_neox, n_experts=cfg.n_experts, n_experts_used=cfg.n_experts_used,
                   norm_topk_prob=cfg.norm_topk_prob)  # fmt: skip


class StepInputs(NamedTuple):
    """One step's flat batch, as the kernels read it."""

    token_ids: np.ndarray  # (num_tokens,) int32
    embedding_rows: np.ndarray  # (num_tokens, row_bytes) uint8 their token embedding rows (KernelWeights.token_rows)
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    logit_rows: np.ndarray  # rows that go through the final norm (scratch.final), in output order
    num_head_rows: int  # the first rows of those also go through the LM head; the rest are pooled (embeddings)


def feed_forward_tokens(cfg: ModelConfig, max_tokens: int) -> int:
    """Tokens in one pass of the dense feed-forward: one pass of the gate and up matrices' kernel (whole tiles
    of 16), so splitting a step's feed-forward into passes re-reads no weight the kernel did not already."""
    return min(max_tokens, tokens_per_pass(cfg.dim))


class StepScratch(NamedTuple):
    """Scratch for the largest step, allocated once."""

    x: np.ndarray  # (max_tokens, dim) residual stream
    xb: np.ndarray  # (max_tokens, dim) normed input of a block
    q: np.ndarray  # (max_tokens, n_heads · head_dim)
    k: np.ndarray  # (max_tokens, n_kv_heads · head_dim)
    v: np.ndarray  # (max_tokens, n_kv_heads · head_dim)
    attn: np.ndarray  # (max_tokens, n_heads · head_dim) attention output: q's array, as each attention item
    # (a row and a KV head) reads its query heads into its own scratch before it writes their outputs
    hb: np.ndarray  # (feed_forward_tokens, hidden_dim) SwiGLU output of a pass (no rows in a mixture of experts)
    up: np.ndarray  # (feed_forward_tokens, hidden_dim) the up projection, before the fast kernels' SiLU pass
    hq: np.ndarray  # (feed_forward_tokens, hidden_dim) int8 hb quantized (fast mode); hd, hsum its block fields
    hd: np.ndarray
    hsum: np.ndarray
    hidden_tiles: TileActivations  # hq again in AMX tiles' layout, or none
    final: np.ndarray  # (max_logit_rows, dim) final-normed rows: those that sample, then those pooled
    logits: np.ndarray  # (max_logit_rows, vocab) of the rows that sample
    row_buffers: np.ndarray  # (n_threads, 2, max(dim, hidden_dim, q_dim)) dequantized weight rows
    attn_scratch: np.ndarray  # kvcache.attention.attention_scratch
    xq: np.ndarray  # (max(max_tokens, max_logit_rows), max(dim, q_dim)) int8 quantized activations (fast mode)
    xd: np.ndarray  # (same rows, that / 32, 2) float32 their blocks' scales and masses (activation_arrays)
    xsum: np.ndarray  # (same rows, that / 32, 2) int32 their blocks' sums, a sum per half
    group_out: np.ndarray  # (n_threads, 2, 8, 8) float32 results of one 8-row group for up to 8 tokens
    tiles: TileActivations  # the activations again in AMX tiles' layout (decoding.kernels.amx), or none
    untiled: TileActivations  # none: for the experts' gathered rows
    tile_out: np.ndarray  # (n_threads, 2, …) float32: amx.tile_scratch
    phase_cycles: np.ndarray  # (len(PHASES),) int64 cycles per phase while profiling, else empty
    # a mixture of experts (decoding.kernels.experts); a pair is one (token, chosen expert); no rows if dense
    expert_scores: np.ndarray  # (max_tokens, n_experts) float32 router probabilities
    expert_choices: np.ndarray  # (max_tokens, n_used) int64 each token's experts, best first
    expert_weights: np.ndarray  # (max_tokens, n_used) float32 their weights
    expert_offsets: np.ndarray  # (n_threads, n_experts + 1) int64 where each expert's pairs begin
    expert_cursor: np.ndarray  # (n_threads, n_experts) int64
    pair_token: np.ndarray  # (n_threads, max_pairs) int64 each pair's token
    pair_of: np.ndarray  # (n_threads, max_pairs) int64 where token t's choice j landed
    pair_rows: np.ndarray  # (max_pairs, dim) float32 gathered inputs, then the experts' outputs
    pair_hidden: np.ndarray  # (max_pairs, hidden_dim) float32
    pair_up: np.ndarray  # (max_pairs, hidden_dim) float32
    pair_q: np.ndarray  # (max_pairs, max(dim, hidden_dim)) int8 quantized gathered inputs, then hidden rows
    pair_d: np.ndarray  # (max_pairs, max(dim, hidden_dim) / 32, 2) float32
    pair_sum: np.ndarray  # (max_pairs, max(dim, hidden_dim) / 32, 2) int32

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_tokens: int, max_logit_rows: int, n_threads: int,
                 block_size: int, tile_mode: int = 0, feed_forward_rows: int | None = None) -> StepScratch:
        """`feed_forward_rows`: tokens per pass of the dense feed-forward (default feed_forward_tokens; a
        multiple of 16 where tiles are in use)."""
        def zeros(*shape: int) -> np.ndarray:
            return np.zeros(shape, dtype=np.float32)

        widest = max(cfg.dim, cfg.hidden_dim, cfg.q_dim)
        rows = max(max_tokens, max_logit_rows)
        dense_rows = 0 if cfg.is_moe else feed_forward_rows or feed_forward_tokens(cfg, max_tokens)
        experts, used = cfg.n_experts, cfg.n_experts_used
        pairs, pair_width = max_tokens * used, max(cfg.dim, cfg.hidden_dim) if cfg.is_moe else 32
        xq, xd, xsum = activation_arrays(rows, max(cfg.dim, cfg.q_dim))
        hq, hd, hsum = activation_arrays(dense_rows, cfg.hidden_dim)
        pair_q, pair_d, pair_sum = activation_arrays(pairs, pair_width)
        q = zeros(max_tokens, cfg.q_dim)
        return cls(
            x=zeros(max_tokens, cfg.dim), xb=zeros(max_tokens, cfg.dim), q=q,
            k=zeros(max_tokens, cfg.kv_dim), v=zeros(max_tokens, cfg.kv_dim), attn=q,
            hb=zeros(dense_rows, cfg.hidden_dim), up=zeros(dense_rows, cfg.hidden_dim), hq=hq, hd=hd, hsum=hsum,
            hidden_tiles=tile_activations(tile_mode, dense_rows, cfg.hidden_dim),
            final=zeros(max_logit_rows, cfg.dim), logits=zeros(max_logit_rows, cfg.vocab_size),
            row_buffers=zeros(n_threads, 2, widest),
            attn_scratch=attention_scratch(n_threads, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, block_size),
            xq=xq, xd=xd, xsum=xsum,
            group_out=zeros(n_threads, 2, MOST_GROUP_TOKENS, GROUP_ROWS),
            tiles=tile_activations(tile_mode, rows, max(cfg.dim, cfg.q_dim)), untiled=tile_activations(0, 0, 0),
            tile_out=tile_scratch(n_threads, tile_mode, widest, rows), phase_cycles=no_profile(),
            expert_scores=zeros(max_tokens if experts else 0, experts),
            expert_choices=np.zeros((max_tokens, used), dtype=np.int64), expert_weights=zeros(max_tokens, used),
            expert_offsets=np.zeros((n_threads, experts + 1), dtype=np.int64),
            expert_cursor=np.zeros((n_threads, experts), dtype=np.int64),
            pair_token=np.zeros((n_threads, pairs), dtype=np.int64),
            pair_of=np.zeros((n_threads, pairs), dtype=np.int64), pair_rows=zeros(pairs, cfg.dim),
            pair_hidden=zeros(pairs, cfg.hidden_dim), pair_up=zeros(pairs, cfg.hidden_dim),
            pair_q=pair_q, pair_d=pair_d, pair_sum=pair_sum,
        )  # fmt: skip


@njit(nogil=True, cache=True)
def project(fast, weight, packed, qtype, packed_qtype, n_rows, n_cols, x, xq, xd, xsum, n_tokens, out, accumulate,
            tid, nthreads, buf, group_out, tiles, tile_out):  # fmt: skip
    """out[t, :n_rows] (+)= W · x[t]: int8 (VNNI, AMX tiles) over the repacked weights when there are some,
    else float32."""
    if fast and packed.shape[0] > 0:
        g0, g1 = split_range(n_rows // 8, tid, nthreads)
        matmul_groups(packed, packed_qtype, n_cols, xq, xd, xsum, n_tokens, out, g0, g1, accumulate, group_out,
                      tiles, tile_out)
    else:
        r0, r1 = split_range(n_rows, tid, nthreads)
        matmul_rows(weight, qtype, n_cols, x, n_tokens, out, 0, r0, r1, accumulate, buf)


@njit(nogil=True, cache=True)
def quantize_rows(fast, x, n_cols, row_begin, row_end, xq, xd, xsum, tiles, n_tokens):
    """Rows [row_begin, row_end) of the n_tokens of x to int8 for the fast kernels (and the tiles)."""
    if fast:
        quantize_activation_rows(x, n_cols, row_begin, row_end, xq, xd, xsum, tiles, n_tokens)


@njit(nogil=True, cache=True)
def add_normed(x, out, weight, eps, t_begin, t_end):
    """x[t] += RMSNorm(out[t]) (a post-norm block joining the residual); `out` is normed in place."""
    for t in range(t_begin, t_end):
        rmsnorm_row(out[t], weight, eps, out[t])
        x[t] += out[t]


# fmt: off
@njit(nogil=True, cache=True)
def model_step(tid, nthreads, barrier, fast, step, matrices, packed, weights, arch, key_cache, value_cache, scratch):
    """One engine step on thread `tid` of `nthreads`: `step` (StepInputs) through every layer with
    `weights` (WeightArrays, beside the layers' `matrices` and their `packed` copies) and `arch`
    (Architecture), KV written to and read from the paged caches, `scratch` (StepScratch) for the
    activations; `step.logit_rows` final-normed end in `scratch.final`, the logits of the first
    `step.num_head_rows` of them in `scratch.logits`."""
    token_ids, positions, slot_mapping = step.token_ids, step.positions, step.slot_mapping
    block_tables, context_lens, query_start_loc = step.block_tables, step.context_lens, step.query_start_loc
    logit_rows = step.logit_rows
    qtypes, packed_qtypes, norms, biases = weights.qtypes, weights.packed_qtypes, weights.norms, weights.biases
    head_norms, layer_windows, layer_ropes = weights.head_norms, weights.layer_windows, weights.layer_ropes
    embedding_rows, embedding_qtype = step.embedding_rows, weights.embedding_qtype
    lm_head, lm_head_qtype = weights.lm_head, weights.lm_head_qtype
    lm_head_packed, lm_head_packed_qtype = weights.lm_head_packed, weights.lm_head_packed_qtype
    output_norm, rope_cos, rope_sin = weights.output_norm, weights.rope_cos, weights.rope_sin
    n_heads, n_kv_heads, head_dim, rms_eps = arch.n_heads, arch.n_kv_heads, arch.head_dim, arch.rms_eps
    qkv_bias, qk_norm, post_norms, activation = arch.qkv_bias, arch.qk_norm, arch.post_norms, arch.activation
    embedding_scale, query_scale, rope_neox = arch.embedding_scale, arch.query_scale, arch.rope_neox
    n_experts, n_experts_used, norm_topk_prob = arch.n_experts, arch.n_experts_used, arch.norm_topk_prob
    routers, key_centres = weights.routers, weights.key_centres
    x, xb, q, k, v, attn = scratch.x, scratch.xb, scratch.q, scratch.k, scratch.v, scratch.attn
    hb, up, final, logits = scratch.hb, scratch.up, scratch.final, scratch.logits
    row_buffers, attn_scratch, group_out = scratch.row_buffers, scratch.attn_scratch, scratch.group_out
    xq, xd, xsum, phase_cycles = scratch.xq, scratch.xd, scratch.xsum, scratch.phase_cycles
    tiles = scratch.tiles
    n_tokens = token_ids.shape[0]
    n_layers = qtypes.shape[0]
    dim = x.shape[1]
    hidden_dim = hb.shape[1]
    q_dim = n_heads * head_dim
    kv_dim = n_kv_heads * head_dim
    buf = row_buffers[tid]
    tmp = group_out[tid]
    tile_out = scratch.tile_out[tid]
    t_begin, t_end = split_range(n_tokens, tid, nthreads)
    profile = phase_cycles if tid == 0 else phase_cycles[:0]  # thread 0 times the phases
    clock = cycle_counter() if profile.shape[0] > 0 else 0

    for t in range(t_begin, t_end):  # token embeddings
        dequantize_row(embedding_rows[t], embedding_qtype, dim, x[t])
        if embedding_scale != 1.0:
            for j in range(dim):
                x[t, j] *= embedding_scale
    barrier_wait(barrier, tid)
    clock = lap(profile, EMBED, clock)

    for layer in range(n_layers):
        w = layer * 7
        for t in range(t_begin, t_end):  # attention RMSNorm
            rmsnorm_row(x[t], norms[layer, 0], rms_eps, xb[t])
        quantize_rows(fast, xb, dim, t_begin, t_end, xq, xd, xsum, tiles, n_tokens)
        barrier_wait(barrier, tid)
        clock = lap(profile, ATTENTION_NORM, clock)

        # Q, K, V projections
        project(fast, matrices[w], packed[w], qtypes[layer, 0], packed_qtypes[layer, 0],
                q_dim, dim, xb, xq, xd, xsum, n_tokens, q, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        project(fast, matrices[w + 1], packed[w + 1], qtypes[layer, 1], packed_qtypes[layer, 1],
                kv_dim, dim, xb, xq, xd, xsum, n_tokens, k, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        project(fast, matrices[w + 2], packed[w + 2], qtypes[layer, 2], packed_qtypes[layer, 2],
                kv_dim, dim, xb, xq, xd, xsum, n_tokens, v, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        barrier_wait(barrier, tid)
        clock = lap(profile, QKV, clock)

        rope = layer_ropes[layer]
        for t in range(t_begin, t_end):  # biases, head norms and RoPE on queries and keys
            if qkv_bias:
                bias = biases[layer]
                for j in range(q_dim):
                    q[t, j] += bias[j]
                for j in range(kv_dim):
                    k[t, j] += bias[q_dim + j]
                    v[t, j] += bias[q_dim + kv_dim + j]
            if qk_norm:
                head_rmsnorm_row(q[t], n_heads, head_dim, head_norms[layer, 0], rms_eps)
                head_rmsnorm_row(k[t], n_kv_heads, head_dim, head_norms[layer, 1], rms_eps)
            position = positions[t]
            rope_row(q[t], n_heads, head_dim, rope_cos[rope, position], rope_sin[rope, position], rope_neox)
            rope_row(k[t], n_kv_heads, head_dim, rope_cos[rope, position], rope_sin[rope, position], rope_neox)
            if is_int8(key_cache[0, 0, 0, 0, 0]):  # int8 KV: outlier channels spread, keys centred, then stored
                rotate_q8_groups(q[t], q_dim)
                rotate_q8_groups(k[t], kv_dim)
                for j in range(kv_dim):  # every score of a query moves by the same q·c: the softmax removes it
                    k[t, j] -= key_centres[layer, j]
        barrier_wait(barrier, tid)
        clock = lap(profile, ROPE, clock)
        keys = k[:n_tokens].reshape((n_tokens, n_kv_heads, head_dim))
        values = v[:n_tokens].reshape((n_tokens, n_kv_heads, head_dim))
        write_kv_rows(keys, values, key_cache[layer], value_cache[layer], slot_mapping, tid, nthreads)
        barrier_wait(barrier, tid)
        clock = lap(profile, KV_WRITE, clock)

        queries = q.reshape((q.shape[0], n_heads, head_dim))  # paged attention
        attn_out = attn.reshape((attn.shape[0], n_heads, head_dim))
        paged_attention_rows(attn_out, queries, key_cache[layer], value_cache[layer], block_tables, context_lens,
                             query_start_loc, attn_scratch, tid, nthreads, query_scale, layer_windows[layer])
        barrier_wait(barrier, tid)
        clock = lap(profile, ATTENTION, clock)
        if fast:
            quantize_rows(fast, attn, q_dim, t_begin, t_end, xq, xd, xsum, tiles, n_tokens)
            barrier_wait(barrier, tid)
            clock = lap(profile, QUANTIZE_ATTENTION, clock)

        # output projection, added to the residual (through its own RMSNorm where there are post-norms)
        project(fast, matrices[w + 3], packed[w + 3], qtypes[layer, 3], packed_qtypes[layer, 3],
                dim, q_dim, attn, xq, xd, xsum, n_tokens, xb if post_norms else x,
                not post_norms, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
        barrier_wait(barrier, tid)
        clock = lap(profile, OUTPUT_PROJECTION, clock)
        if post_norms:  # the same rows as this thread's feed-forward norm below: no barrier between
            add_normed(x, xb, norms[layer, 2], rms_eps, t_begin, t_end)

        for t in range(t_begin, t_end):  # feed-forward RMSNorm
            rmsnorm_row(x[t], norms[layer, 1], rms_eps, xb[t])
        quantize_rows(fast, xb, dim, t_begin, t_end, xq, xd, xsum, tiles, n_tokens)
        if n_experts > 0:
            route_tokens(xb, routers[layer], n_experts_used, norm_topk_prob, t_begin, t_end, scratch.expert_scores,
                         scratch.expert_choices, scratch.expert_weights)
        barrier_wait(barrier, tid)
        clock = lap(profile, FFN_NORM, clock)

        if n_experts > 0:  # a mixture of experts, added to the residual by each thread for its own tokens
            clock = expert_feed_forward(
                tid, nthreads, barrier, fast, n_tokens, t_begin, t_end, x, xb, xq, xd, xsum, matrices[w + 4],
                matrices[w + 5], matrices[w + 6], packed[w + 4], packed[w + 5], packed[w + 6], qtypes[layer],
                packed_qtypes[layer], n_experts, activation, scratch.expert_choices, scratch.expert_weights,
                scratch.expert_offsets[tid], scratch.expert_cursor[tid], scratch.pair_token[tid], scratch.pair_of[tid],
                scratch.pair_rows, scratch.pair_hidden, scratch.pair_up, scratch.pair_q, scratch.pair_d,
                scratch.pair_sum, buf, tmp, scratch.untiled, tile_out, profile, clock)
            if layer == n_layers - 1:  # the next layer's norm reads only this thread's rows; the final norm not
                barrier_wait(barrier, tid)
            clock = lap(profile, COMBINE_EXPERTS, clock)
            continue

        # the gated feed-forward in passes of hb's rows: the hidden rows, 5x a token's width, exist for one
        # pass at a time; each pass's down projection is added to the residual (through its own RMSNorm where
        # there are post-norms)
        ffn_out = xb if post_norms else x
        for first in range(0, n_tokens, hb.shape[0]):
            count = min(hb.shape[0], n_tokens - first)
            if fast and packed[w + 4].shape[0] > 0 and packed[w + 5].shape[0] > 0:
                g0, g1 = split_range(hidden_dim // 8, tid, nthreads)
                swiglu_groups(packed[w + 4], packed[w + 5], packed_qtypes[layer, 4], packed_qtypes[layer, 5], dim,
                              xq[first:], xd[first:], xsum[first:], count, hb, up, g0, g1, tmp[0], tmp[1], activation,
                              tiles_from(tiles, first), tile_out)
            else:
                r0, r1 = split_range(hidden_dim, tid, nthreads)
                swiglu_rows(matrices[w + 4], qtypes[layer, 4], matrices[w + 5], qtypes[layer, 5], dim, xb[first:],
                            count, hb, r0, r1, buf[0], buf[1], activation)
            barrier_wait(barrier, tid)
            clock = lap(profile, GATE_UP, clock)
            if fast:
                h0, h1 = split_range(count, tid, nthreads)
                quantize_rows(fast, hb, hidden_dim, h0, h1, scratch.hq, scratch.hd, scratch.hsum,
                              scratch.hidden_tiles, count)
                barrier_wait(barrier, tid)
                clock = lap(profile, QUANTIZE_HIDDEN, clock)
            project(fast, matrices[w + 6], packed[w + 6], qtypes[layer, 6], packed_qtypes[layer, 6],
                    dim, hidden_dim, hb, scratch.hq, scratch.hd, scratch.hsum, count, ffn_out[first:], not post_norms,
                    tid, nthreads, buf[0], tmp[0], scratch.hidden_tiles, tile_out[0])
            barrier_wait(barrier, tid)
            clock = lap(profile, DOWN_PROJECTION, clock)
        if post_norms:  # the final norm below reads rows of other threads: a barrier after
            add_normed(x, xb, norms[layer, 3], rms_eps, t_begin, t_end)
            barrier_wait(barrier, tid)
            clock = lap(profile, POST_NORMS, clock)

    n_rows = logit_rows.shape[0]
    i0, i1 = split_range(n_rows, tid, nthreads)
    for i in range(i0, i1):  # final RMSNorm, only for rows that sample or are pooled
        rmsnorm_row(x[logit_rows[i]], output_norm, rms_eps, final[i])
    quantize_rows(fast, final, dim, i0, i1, xq, xd, xsum, tiles, step.num_head_rows)
    barrier_wait(barrier, tid)
    clock = lap(profile, FINAL_NORM, clock)
    vocab = logits.shape[1]  # LM head
    project(fast, lm_head, lm_head_packed, lm_head_qtype, lm_head_packed_qtype, vocab, dim, final, xq, xd, xsum,
            step.num_head_rows, logits, False, tid, nthreads, buf[0], tmp[0], tiles, tile_out[0])
    lap(profile, LM_HEAD, clock)  # thread 0's share: the pool's end is the step's last barrier
# fmt: on
