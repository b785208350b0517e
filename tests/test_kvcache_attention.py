"""Paged attention equals dense causal attention, and never depends on threads, neighbours or chunking."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from kvcache.attention import attention_scratch, paged_attention_rows, quantize_query_q8, write_kv_rows
from kvcache.attention_simd import SIMD_BLOCK_SIZE, attend_heads, q8_dither
from kvcache.storage import Q8_GROUP, KVCacheSpec


@dataclass(slots=True)
class PagedCase:
    """Random sequences laid out in a paged cache with shuffled, non-contiguous block ids."""

    keys: list[np.ndarray]  # per sequence (context_len, n_kv_heads, head_dim) float32
    values: list[np.ndarray]  # per sequence (context_len, n_kv_heads, head_dim) float32
    queries: list[np.ndarray]  # per sequence (context_len, n_heads, head_dim) float32: one per position
    block_tables: np.ndarray  # (num_seqs, max_blocks) int32
    key_cache: np.ndarray  # (n_kv_heads, num_blocks, head_dim, block_size) float32, or uint16 half floats
    value_cache: np.ndarray  # (n_kv_heads, num_blocks, block_size, head_dim) like key_cache


STORAGE = {
    "float32": (np.float32, np.float32(np.nan)),
    "float16": (np.uint16, np.float16(np.nan).view(np.uint16)),
    "int8": (np.int8, np.int8(-1)),  # every byte 0xFF: the fp16 scales of unused slots are NaN
}


def make_case(
    rng: np.random.Generator,
    context_lens: list[int],
    block_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    storage: str = "float32",
) -> PagedCase:
    """With half-float storage the case's keys and values are the half-rounded ones the cache holds, so a
    dense reference over them sees exactly the kernel's inputs."""
    stored_type, nan = STORAGE[storage]
    num_blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(num_blocks_per_seq) + 3  # a few blocks nobody owns
    shuffled_ids = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.zeros((len(context_lens), max(num_blocks_per_seq)), dtype=np.int32)
    taken = 0
    for seq, n in enumerate(num_blocks_per_seq):
        block_tables[seq, :n] = shuffled_ids[taken : taken + n]
        taken += n
    # NaN everywhere the kernel must not read: unused slots, unused blocks.
    if storage == "int8" and head_dim % Q8_GROUP:
        pytest.skip(f"an int8 cache needs head_dim a multiple of {Q8_GROUP}")
    width = KVCacheSpec(head_dim=head_dim, dtype=storage).row_width
    key_cache = np.full((n_kv_heads, num_blocks, width, block_size), nan, dtype=stored_type)
    value_cache = np.full((n_kv_heads, num_blocks, block_size, width), nan, dtype=stored_type)
    keys, values, queries = [], [], []
    for seq, context_len in enumerate(context_lens):
        keys.append(
            _as_stored(rng.standard_normal((context_len, n_kv_heads, head_dim), dtype=np.float32), storage)
        )
        values.append(
            _as_stored(rng.standard_normal((context_len, n_kv_heads, head_dim), dtype=np.float32), storage)
        )
        queries.append(rng.standard_normal((context_len, n_heads, head_dim), dtype=np.float32))
        positions = np.arange(context_len)
        slots = (block_tables[seq, positions // block_size] * block_size + positions % block_size).astype(
            np.int32
        )
        write_kv_rows(keys[-1], values[-1], key_cache, value_cache, slots, 0, 1)
    return PagedCase(keys, values, queries, block_tables, key_cache, value_cache)


def _as_stored(x: np.ndarray, storage: str) -> np.ndarray:
    if storage == "int8":
        return dequantized_q8(*quantized_q8(x))
    return x.astype(np.float16).astype(np.float32) if storage == "float16" else x


def quantized_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., head_dim) float32 → int8 values and fp16 scales per group of Q8_GROUP, in the kernel's float32
    steps: scale = max|x| / 127, q = x · (127 / max|x|) rounded half away from zero."""
    groups = x.reshape(*x.shape[:-1], -1, Q8_GROUP)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    scaled = (groups * inverse).astype(np.float32)
    q = np.where(scaled >= 0, np.floor(scaled + np.float32(0.5)), -np.floor(-scaled + np.float32(0.5)))
    return np.clip(q, -127, 127).astype(np.int8), (amax / np.float32(127.0)).astype(np.float16)


def dequantized_q8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    values = q.astype(np.float32) * scales.astype(np.float32)
    return values.reshape(*values.shape[:-2], -1)


def run_paged(
    case: PagedCase, seqs: list[int], context_lens: list[int], query_lens: list[int], nthreads: int = 1,
    scratch: np.ndarray | None = None, window: int = 0, in_place: bool = False,
) -> np.ndarray:  # fmt: skip
    """Attention of the last query_lens[i] positions of seqs[i], its context cut at context_lens[i];
    the threads are simulated one after another. scratch: default `attention_scratch`'s. Arrays and
    scale have the types the step passes (C-contiguous, float32): each other type compiles the kernel
    again (~15-20 s of the test run's CPU)."""
    query = np.ascontiguousarray(np.concatenate(
        [case.queries[seq][n - q : n] for seq, n, q in zip(seqs, context_lens, query_lens, strict=True)]
    ))  # fmt: skip
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    n_heads, head_dim = case.queries[0].shape[1:]
    n_kv_heads, block_size = case.key_cache.shape[0], case.key_cache.shape[3]
    out = query if in_place else np.full_like(query, np.nan)
    if scratch is None:
        scratch = attention_scratch(nthreads, n_heads, n_kv_heads, head_dim, block_size)
    for tid in range(nthreads):
        paged_attention_rows(
            out,
            query,
            case.key_cache,
            case.value_cache,
            case.block_tables[seqs],
            np.asarray(context_lens, dtype=np.int32),
            query_start_loc,
            scratch,
            tid,
            nthreads,
            np.float32(1.0 / np.sqrt(head_dim)),
            window,
        )
    return out


def dense_causal_attention(
    keys: np.ndarray, values: np.ndarray, queries: np.ndarray, query_len: int, window: int = 0
) -> np.ndarray:
    """Plain float64 softmax(q k^T / sqrt(d)) v over positions 0..p (p - window + 1..p with a window),
    for the last query_len positions p."""
    context_len, n_kv_heads, head_dim = keys.shape
    n_heads = queries.shape[1]
    group_size = n_heads // n_kv_heads
    out = np.empty((query_len, n_heads, head_dim))
    for i in range(query_len):
        position = context_len - query_len + i
        for head in range(n_heads):
            first = max(0, position - window + 1) if window else 0
            k = keys[first : position + 1, head // group_size].astype(np.float64)
            v = values[first : position + 1, head // group_size].astype(np.float64)
            scores = k @ queries[position, head].astype(np.float64) / np.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            out[i, head] = weights @ v / weights.sum()
    return out


# (context_lens, query_lens, block_size, n_heads, n_kv_heads, head_dim)
CASES = [
    ([1], [1], 16, 9, 3, 64),  # a one-token prompt
    ([37, 16, 100], [1, 1, 1], 16, 9, 3, 64),  # decode batch, the default model's heads
    ([48], [48], 16, 9, 3, 64),  # whole prompt, context a multiple of the block
    ([70, 33], [25, 33], 8, 4, 1, 32),  # a prefill chunk after earlier context, GQA 4:1
    ([5, 129, 64], [5, 1, 17], 4, 2, 2, 16),  # no grouping (MHA), tiny blocks
    ([300], [7], 32, 6, 2, 8),  # long context, block larger than head_dim
    ([3, 17, 31, 50], [1, 16, 2, 50], 16, 8, 2, 64),  # mixed decode and prefill
    ([40, 17], [3, 17], 16, 4, 2, 128),  # head_dim 128 (Llama-sized): the other vector-IR shape, groups of 2
    ([33, 5], [33, 1], 16, 8, 2, 128),  # groups of 4
    ([21, 40], [4, 1], 16, 5, 1, 64),  # a group of 5 at 64: calls of 3 and 2 heads
    ([45, 20], [1, 20], 16, 12, 2, 128),  # groups of 6 (Qwen2.5-1.5B): calls of 3 and 3
    ([38], [2], 16, 28, 4, 128),  # groups of 7 (Qwen2.5-7B): 4 and 3
    ([50, 3], [1, 3], 16, 16, 2, 128),  # groups of 8 (Qwen2.5-3B): 4 and 4
    ([29], [29], 16, 10, 2, 128),  # groups of 5: 3 and 2
    ([33], [1], 16, 12, 2, 64),  # groups of 6 at 64: 3 and 3
    ([30], [30], 16, 4, 4, 64),  # groups of 1 (no GQA)
    ([41, 70], [1, 23], 16, 4, 1, 256),  # Gemma 3's heads of 256 (270M, 1B): groups of 4
    ([36, 3], [2, 3], 16, 8, 4, 256),  # groups of 2 (Gemma 3 4B)
]


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(
    ("context_lens", "query_lens", "block_size", "n_heads", "n_kv_heads", "head_dim"), CASES
)
def test_paged_attention_equals_dense_causal_attention(
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    storage: str,
) -> None:
    rng = np.random.default_rng(sum(context_lens) * 7 + block_size)
    case = make_case(rng, context_lens, block_size, n_heads, n_kv_heads, head_dim, storage)
    seqs = list(range(len(context_lens)))
    assert_equals_dense(run_paged(case, seqs, context_lens, query_lens, nthreads=2), case, seqs, query_lens)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("group_size", "head_dim"),
                         [(5, 128), (6, 128), (7, 128), (8, 128), (6, 64), (5, 64), (6, 256)])  # fmt: skip
def test_how_a_large_group_is_cut_into_calls_changes_no_output(group_size: int, head_dim: int, storage: str) -> None:
    """A group too large for one vector-IR call is served in calls of up to four heads: each head's
    output is bit for bit what it is alone (a group of one over the same keys and values)."""
    rng = np.random.default_rng(group_size * head_dim)
    context_lens, query_lens = [70, 19], [1, 19]
    case = make_case(rng, context_lens, 16, 2 * group_size, 2, head_dim, storage)
    grouped = run_paged(case, [0, 1], context_lens, query_lens)
    for head in range(group_size):  # heads `head` and `group_size + head` read KV heads 0 and 1
        alone = replace(case, queries=[q[:, [head, group_size + head]] for q in case.queries])
        single = run_paged(alone, [0, 1], context_lens, query_lens)
        np.testing.assert_array_equal(single, grouped[:, [head, group_size + head]])


def dense(case: PagedCase, seq: int, query_len: int, window: int = 0) -> np.ndarray:
    return dense_with_tolerance(case, seq, query_len, window)[0]


def dense_with_tolerance(case: PagedCase, seq: int, query_len: int, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The dense reference and how far each output may be from it: 1e-5 (float32 rounding); with an
    int8 cache, plus what one byte weight can move its group of outputs (the kernel computes the byte
    weights in float32, the reference in float64: one that lies within their rounding of a step may be
    cut the other way)."""
    if case.key_cache.dtype == np.int8:
        out, byte_step = dense_int8_attention(case.keys[seq], case.values[seq], int8_queries(case.queries[seq]),
                                              query_len, case.key_cache.shape[-1], window)  # fmt: skip
        return out, 1e-5 + 1.01 * byte_step
    out = dense_causal_attention(case.keys[seq], case.values[seq], case.queries[seq], query_len, window)
    return out, np.full(out.shape, 1e-5)


def assert_equals_dense(out: np.ndarray, case: PagedCase, seqs: list[int], query_lens: list[int],
                        window: int = 0) -> None:  # fmt: skip
    expected, tolerance = (np.concatenate(parts) for parts in zip(
        *(dense_with_tolerance(case, seq, query_len, window) for seq, query_len in zip(seqs, query_lens, strict=True)),
        strict=True))  # fmt: skip
    error = np.abs(out - expected) - 1e-5 * np.abs(expected)
    excess = error - tolerance
    assert np.all(excess <= 0), f"{np.count_nonzero(excess > 0)} outputs beyond tolerance, by up to {excess.max():.3g}"
    # a byte rounded the other way is rare: a systematic error (a rounding rule, a scale) moves most outputs
    assert np.mean(error > 1e-5) < 0.1, f"{np.mean(error > 1e-5):.1%} of outputs are more than 1e-5 off"


def dense_int8_attention(
    keys: np.ndarray, values: np.ndarray, queries: np.ndarray, query_len: int, block_size: int, window: int = 0
) -> np.ndarray:
    """`dense_causal_attention` with an int8 cache's value sum, in float64: per block of the cache
    (positions b·block_size.., cut to the window and the causal end) and group of Q8_GROUP
    dimensions, each key's softmax weight w and value scale s become one byte against the block's
    largest of each, a = floor(min(255 · w / W · s / S + q8_dither(key, group), 255)), and the block adds
    Σ a · (value / s) · W · S / 255. `values` are an int8 cache's (each group's values times its scale).
    Also returns, per output, what one byte weight of its group can move it: max over blocks of
    W · S · 127 / 255, over the softmax's sum."""
    context_len, n_kv_heads, head_dim = keys.shape
    group_values = values.reshape(context_len, n_kv_heads, -1, Q8_GROUP).astype(np.float64)
    value_scales = np.abs(group_values).max(axis=-1) / 127  # a group's largest value is 127 steps
    ints = np.divide(group_values, value_scales[..., None], out=np.zeros_like(group_values),
                     where=value_scales[..., None] > 0)  # fmt: skip
    n_heads = queries.shape[1]
    group_size = n_heads // n_kv_heads
    out, byte_step = np.empty((query_len, n_heads, head_dim)), np.zeros((query_len, n_heads, head_dim))
    for i in range(query_len):
        position = context_len - query_len + i
        first = max(0, position - window + 1) if window else 0
        for head in range(n_heads):
            kv_head = head // group_size
            k = keys[first : position + 1, kv_head].astype(np.float64)
            scores = k @ queries[position, head].astype(np.float64) / np.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            total = np.zeros(head_dim)
            for begin, end in int8_calls(first, position, block_size, head_dim):
                w = weights[begin - first : end - first]
                for g in range(head_dim // Q8_GROUP):
                    s = value_scales[begin:end, kv_head, g]
                    if w.max() <= 1e-30 or s.max() == 0:
                        continue
                    dither = np.array([q8_dither(key % block_size, g) for key in range(begin, end)])
                    a = np.floor(np.minimum(255 * w / w.max() * (s / s.max()) + dither, 255))
                    dims = slice(g * Q8_GROUP, (g + 1) * Q8_GROUP)
                    total[dims] += (a @ ints[begin:end, kv_head, g]) * w.max() * s.max() / 255
                    byte_step[i, head, dims] = np.maximum(byte_step[i, head, dims], w.max() * s.max() * 127 / 255)
            out[i, head] = total / weights.sum()
            byte_step[i, head] /= weights.sum()
    return out, byte_step


def int8_calls(first: int, position: int, block_size: int, head_dim: int) -> list[tuple[int, int]]:
    """The key ranges [begin, end) whose value bytes an int8 cache's kernel sets against one largest
    weight and scale, for a query at `position` that sees keys first..position: each block alone, or,
    on the vector IR's path with heads of 64 or 128 (16-key blocks), the blocks paired by position
    (2k, 2k + 1) where both are read and the first is read whole."""
    vector_ir = block_size == SIMD_BLOCK_SIZE and head_dim in (64, 128)
    calls, block = [], first // block_size
    while block <= position // block_size:
        begin = max(first, block * block_size)
        paired = vector_ir and begin == block * block_size and block % 2 == 0 and block < position // block_size
        block += 2 if paired else 1
        calls.append((begin, min(position + 1, block * block_size)))
    return calls


def int8_queries(queries: np.ndarray) -> np.ndarray:
    """The queries an int8 cache's scores see: q / sqrt(head_dim) in float32, quantized per group of
    Q8_GROUP like a key but with a float32 scale (max|x| / 127), then the 1 / sqrt(head_dim) taken
    back for `dense_causal_attention` to apply again."""
    head_dim = queries.shape[-1]
    scale = np.float32(1.0 / np.sqrt(head_dim))
    scaled = queries.astype(np.float32) * scale
    ints, _ = quantized_q8(scaled)
    amax = np.abs(scaled.reshape(*scaled.shape[:-1], -1, Q8_GROUP)).max(axis=-1, keepdims=True)
    values = ints.astype(np.float64) * (amax / np.float32(127.0)).astype(np.float32)
    return values.reshape(queries.shape) / np.float64(scale)


# (context_lens, query_lens, block_size, n_heads, n_kv_heads, head_dim, window)
WINDOW_CASES = [
    ([100, 37, 9], [1, 1, 1], 16, 4, 1, 256, 20),  # Gemma 3's heads; the window opens inside a block
    ([90, 64], [40, 64], 16, 8, 2, 64, 32),  # prefill chunks, a window of exactly two blocks (vector IR)
    ([200], [13], 16, 4, 2, 128, 17),  # every row's window starts at a different offset
    ([30, 5], [30, 5], 8, 2, 2, 16, 64),  # a window longer than the context: plain causal attention
    ([50], [50], 16, 2, 1, 64, 1),  # a window of one: each position sees only itself
]


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(
    ("context_lens", "query_lens", "block_size", "n_heads", "n_kv_heads", "head_dim", "window"), WINDOW_CASES
)
def test_sliding_window_attention_equals_dense_windowed_attention(
    context_lens: list[int], query_lens: list[int], block_size: int, n_heads: int, n_kv_heads: int,
    head_dim: int, window: int, storage: str,
) -> None:  # fmt: skip
    case = make_case(
        np.random.default_rng(window), context_lens, block_size, n_heads, n_kv_heads, head_dim, storage
    )
    seqs = list(range(len(context_lens)))
    out = run_paged(case, seqs, context_lens, query_lens, nthreads=2, window=window)
    assert_equals_dense(out, case, seqs, query_lens, window)


@pytest.mark.parametrize("storage", STORAGE)
def test_a_windowed_position_is_bit_identical_however_the_prompt_is_chunked(storage: str) -> None:
    case = make_case(np.random.default_rng(12), [120], 16, 4, 1, 256, storage)
    whole = run_paged(case, [0], [120], [120], window=40)
    chunked = np.concatenate([run_paged(case, [0], [end], [end - begin], nthreads=3, window=40)
                              for begin, end in ((0, 7), (7, 64), (64, 65), (65, 120))])  # fmt: skip
    np.testing.assert_array_equal(whole, chunked)


@pytest.mark.parametrize("storage", STORAGE)
def test_long_context_stays_accurate(storage: str) -> None:
    case = make_case(np.random.default_rng(1), [2500], 16, 9, 3, 64, storage)
    assert_equals_dense(run_paged(case, [0], [2500], [3]), case, [0], [3])


def test_softmax_is_stable_for_large_scores() -> None:
    case = make_case(np.random.default_rng(2), [40], 16, 2, 1, 16)
    case.queries[0] *= 300.0  # scores in the thousands: a naive exp overflows to inf
    out = run_paged(case, [0], [40], [40])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense(case, 0, 40), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("nthreads", [2, 3, 5, 8])
def test_output_is_bit_identical_for_any_thread_count(nthreads: int, storage: str) -> None:
    context_lens, query_lens = [90, 1, 33, 64], [30, 1, 1, 64]
    case = make_case(np.random.default_rng(3), context_lens, 16, 9, 3, 64, storage)
    seqs = list(range(4))
    np.testing.assert_array_equal(
        run_paged(case, seqs, context_lens, query_lens, nthreads),
        run_paged(case, seqs, context_lens, query_lens),
    )


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("nthreads", [1, 3])
def test_outputs_written_over_their_queries_are_the_same_bits(nthreads: int, storage: str) -> None:
    """The model step's attention output shares the queries' array: every item reads its query heads
    before any item writes over them, whichever thread runs it."""
    context_lens, query_lens = [90, 1, 33, 64], [30, 1, 1, 64]
    case = make_case(np.random.default_rng(6), context_lens, 16, 9, 3, 64, storage)
    seqs = list(range(4))
    np.testing.assert_array_equal(
        run_paged(case, seqs, context_lens, query_lens, nthreads, in_place=True),
        run_paged(case, seqs, context_lens, query_lens, nthreads),
    )


@pytest.mark.parametrize("nthreads", [2, 3])
def test_each_output_is_written_by_exactly_one_thread(nthreads: int) -> None:
    context_lens, query_lens = [40, 3, 17], [12, 1, 17]
    case = make_case(np.random.default_rng(8), context_lens, 8, 6, 2, 16)
    written = []
    for tid in range(nthreads):  # each thread alone, on an output full of NaN
        query = np.concatenate(
            [case.queries[s][n - q : n] for s, n, q in zip(range(3), context_lens, query_lens, strict=True)]
        )
        out = np.full_like(query, np.nan)
        paged_attention_rows(
            out,
            query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            np.asarray(context_lens, dtype=np.int32),
            np.array([0, 12, 13, 30], dtype=np.int32),
            attention_scratch(nthreads, 6, 2, 16, 8),
            tid,
            nthreads,
            np.float32(0.25),
            0,
        )
        written.append(~np.isnan(out).all(axis=2))  # (num_tokens, n_heads): which outputs this thread wrote
    assert (np.sum(written, axis=0) == 1).all()
    assert all(w.any() for w in written)  # the work is shared, not all done by one thread


@pytest.mark.parametrize("storage", STORAGE)
def test_sequence_output_is_bit_identical_whatever_shares_its_batch(storage: str) -> None:
    case = make_case(np.random.default_rng(4), [57, 200, 13], 16, 9, 3, 64, storage)
    alone = run_paged(case, [1], [200], [40], nthreads=2)
    among_others = run_paged(case, [2, 1, 0], [13, 200, 57], [13, 40, 9], nthreads=3)
    np.testing.assert_array_equal(among_others[13 : 13 + 40], alone)


@pytest.mark.parametrize("storage", STORAGE)
def test_position_output_is_bit_identical_however_the_prompt_is_chunked(storage: str) -> None:
    case = make_case(np.random.default_rng(5), [45], 8, 9, 3, 64, storage)
    whole = run_paged(case, [0], [45], [45])
    chunks = [run_paged(case, [0], [end], [size]) for end, size in ((20, 20), (37, 17), (45, 8))]
    decodes = [run_paged(case, [0], [end], [1]) for end in range(1, 46)]
    np.testing.assert_array_equal(np.concatenate(chunks), whole)
    np.testing.assert_array_equal(np.concatenate(decodes), whole)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("block_size", "n_heads", "head_dim", "window"),
                         [(16, 6, 128, 0), (16, 4, 64, 37), (16, 2, 256, 40), (8, 3, 32, 0), (8, 3, 32, 11)])
def test_rows_that_walk_their_blocks_together_give_each_rows_bits_alone(
    block_size: int, n_heads: int, head_dim: int, window: int, storage: str
) -> None:  # fmt: skip
    """A prefill chunk's rows share an item, up to `rows_together` of them, and walk their blocks
    together: each row's output is the bits it gets alone, with the vector IR's shapes (int8 pairs of
    blocks, windows that open mid-block) and the numba path's, for any number of rows an item takes."""
    case = make_case(np.random.default_rng(head_dim + window), [150, 70], block_size, n_heads, 1, head_dim, storage)
    alone = run_paged(case, [0, 1], [150, 70], [150, 39], nthreads=2, window=window,
                      scratch=attention_scratch(2, n_heads, 1, head_dim, block_size, rows_together=1))  # fmt: skip
    for rows_together in (3, 8, 64):
        scratch = attention_scratch(2, n_heads, 1, head_dim, block_size, rows_together=rows_together)
        together = run_paged(case, [0, 1], [150, 70], [150, 39], nthreads=2, window=window, scratch=scratch)
        np.testing.assert_array_equal(together, alone)
    assert_equals_dense(alone, case, [0, 1], [150, 39], window)


def _strided_view(array: np.ndarray, how: str) -> np.ndarray:
    """The same values, not C-contiguous: each tile stored transposed ("transposed"), a gap after
    each row ("padded_rows"), or every other element of a twice-wider array ("every_other")."""
    if how == "transposed":
        return np.ascontiguousarray(np.swapaxes(array, -1, -2)).swapaxes(-1, -2)
    wide = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), dtype=array.dtype)
    view = wide[..., : array.shape[-1]] if how == "padded_rows" else wide[..., ::2]
    view[...] = array
    return view


def test_arrays_the_vector_ir_reads_by_pointer_must_be_c_contiguous() -> None:
    """16-key blocks at head_dim 64 take the vector-IR path, which reads K/V tiles and scratch rows
    by pointer: strided or transposed views are refused with an error naming each of them, never
    misread; contiguous copies of the same values still equal dense attention. (All three views in
    one call: each refused signature costs a compile attempt of ~10 s, never cached.)"""
    context_lens, query_lens = [40, 17], [3, 17]
    case = make_case(np.random.default_rng(10), context_lens, 16, 6, 2, 64)
    expected = np.concatenate([dense(case, 0, 3), dense(case, 1, 17)])
    scratch = attention_scratch(1, 6, 2, 64, 16)
    strided = replace(case, key_cache=_strided_view(case.key_cache, "transposed"),
                      value_cache=_strided_view(case.value_cache, "padded_rows"))
    with pytest.raises(TypingError) as refused:
        run_paged(strided, [0, 1], context_lens, query_lens, scratch=_strided_view(scratch, "every_other"))
    for name in ("key_cache", "value_cache", "scratch"):
        assert re.search(rf"C-contiguous.*{name} \(array\(float32, \dd, A\)\)", str(refused.value)), name
    out = run_paged(case, [0, 1], context_lens, query_lens, scratch=scratch)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_rows_stores_each_row_at_its_slot_for_any_thread_count() -> None:
    rng = np.random.default_rng(6)
    num_blocks, n_kv_heads, head_dim, block_size = 5, 3, 8, 4
    key = rng.standard_normal((7, n_kv_heads, head_dim), dtype=np.float32)
    value = rng.standard_normal((7, n_kv_heads, head_dim), dtype=np.float32)
    slot_mapping = np.array([17, 3, 0, 19, 8, 9, 4], dtype=np.int32)
    for nthreads in (1, 3):
        key_cache = np.zeros((n_kv_heads, num_blocks, head_dim, block_size), dtype=np.float32)
        value_cache = np.zeros((n_kv_heads, num_blocks, block_size, head_dim), dtype=np.float32)
        for tid in range(nthreads):
            write_kv_rows(key, value, key_cache, value_cache, slot_mapping, tid, nthreads)
        for token, slot in enumerate(slot_mapping):
            block_id, offset = divmod(int(slot), block_size)
            np.testing.assert_array_equal(key_cache[:, block_id, :, offset], key[token])
            np.testing.assert_array_equal(value_cache[:, block_id, offset, :], value[token])
        assert np.count_nonzero(value_cache) == value.size  # nothing written outside the slots


def test_int8_cache_stores_each_group_of_32_with_its_fp16_scale() -> None:
    """What llama.cpp's q8_0 cache holds: per token, head and 32 values, round(x / scale) and the scale."""
    rng = np.random.default_rng(10)
    key = rng.standard_normal((6, 2, 64), dtype=np.float32) * np.float32(3.0)
    key[0, 0, :32] = 0.0  # a group of zeros: scale 0, values 0
    key[1, 1, 5] = 1000.0  # an outlier spends only its own group's precision
    value = -key
    slot_mapping = np.array([5, 0, 11, 2, 7, 3], dtype=np.int32)
    spec = KVCacheSpec(head_dim=64, block_size=8, dtype="int8")
    key_cache = np.zeros((2, 3, spec.row_width, 8), dtype=np.int8)
    value_cache = np.zeros((2, 3, 8, spec.row_width), dtype=np.int8)
    write_kv_rows(key, value, key_cache, value_cache, slot_mapping, 0, 1)
    for token, slot in enumerate(slot_mapping):
        block_id, offset = divmod(int(slot), 8)
        for head in range(2):
            q, scales = quantized_q8(key[token, head])
            # a K tile keeps each quad of dimensions' four bytes of a key together, as k + 128
            key_quads = key_cache[head, block_id].reshape(-1)[: 64 * 8].reshape(16, 8, 4)  # (dim quads, keys, dims)
            np.testing.assert_array_equal(key_quads[:, offset].reshape(-1) ^ np.int8(-128), q.reshape(-1))
            key_scales = key_cache[head, block_id, 64:].reshape(-1).view(np.uint16).reshape(2, 8)[:, offset]
            np.testing.assert_array_equal(key_scales, scales.reshape(-1).view(np.uint16))
            q, scales = quantized_q8(value[token, head])
            # a V tile keeps each quad of keys' four bytes of a dimension together, then (groups, keys) scales
            tile = value_cache[head, block_id].reshape(-1)
            by_quads = tile[: 8 * 64].reshape(2, 64, 4)  # (quads of the 8-key block, dims, keys of a quad)
            np.testing.assert_array_equal(by_quads[offset // 4, :, offset % 4], q.reshape(-1))
            value_scales = tile[8 * 64 :].view(np.uint16).reshape(2, 8)[:, offset]
            np.testing.assert_array_equal(value_scales, scales.reshape(-1).view(np.uint16))
    assert np.all(key_cache[0, 5 // 8].reshape(-1)[: 64 * 8].reshape(16, 8, 4)[:8, 5 % 8] == -128)  # 0 + 128
    restored = dequantized_q8(*quantized_q8(key))
    group_max = np.abs(key.reshape(6, 2, 2, 32)).max(axis=-1, keepdims=True)
    # half a step of the group's scale, plus the scale's own fp16 rounding (2^-11 relative) on every value
    assert np.all(np.abs(restored - key).reshape(6, 2, 2, 32) <= group_max * (1 / 254 + 2**-11) + 1e-7)


def test_half_float_cache_stores_each_value_rounded_to_nearest_half() -> None:
    rng = np.random.default_rng(9)
    key = rng.standard_normal((6, 2, 16), dtype=np.float32) * np.float32(300.0)
    key[0, 0, :4] = [0.0, -0.0, 1e-6, 70000.0]  # signed zero, a subnormal half, overflow to inf
    value = -key
    with np.errstate(over="ignore"):  # 70000 overflows to inf in numpy's reference conversion too
        expected_keys, expected_values = key.astype(np.float16), value.astype(np.float16)
    slot_mapping = np.array([5, 0, 11, 2, 7, 3], dtype=np.int32)
    key_cache = np.zeros((2, 3, 16, 4), dtype=np.uint16)
    value_cache = np.zeros((2, 3, 4, 16), dtype=np.uint16)
    write_kv_rows(key, value, key_cache, value_cache, slot_mapping, 0, 1)
    for token, slot in enumerate(slot_mapping):
        block_id, offset = divmod(int(slot), 4)
        np.testing.assert_array_equal(key_cache[:, block_id, :, offset], expected_keys[token].view(np.uint16))
        np.testing.assert_array_equal(
            value_cache[:, block_id, offset, :], expected_values[token].view(np.uint16)
        )


def test_the_int8_rotation_is_orthonormal_per_group_of_32() -> None:
    """Queries and keys rotated alike keep every q·k; rotating twice gives the row back."""
    from kvcache.attention import rotate_q8_groups

    rng = np.random.default_rng(13)
    q, k = rng.standard_normal(128).astype(np.float32), rng.standard_normal(128).astype(np.float32)
    k[7] = 40.0  # an outlier channel: after the rotation its group's values are all about 40 / sqrt(32)
    rq, rk = q.copy(), k.copy()
    rotate_q8_groups(rq, 128)
    rotate_q8_groups(rk, 128)
    assert abs(float(rq @ rk) - float(q @ k)) < 1e-4 * abs(float(q @ k)) + 1e-4
    assert np.abs(rk[:32]).max() < 10.0 and np.allclose(rk[32:64], rk[32:64])
    twice = rk.copy()
    rotate_q8_groups(twice, 128)
    np.testing.assert_allclose(twice, k, rtol=1e-5, atol=1e-5)


def butterfly_reference(row: np.ndarray) -> np.ndarray:
    """The fast Walsh-Hadamard transform of each 32 values in float32, stage by stride 1, 2, ..., 16, then
    the 1/sqrt(32) scale: the order of operations the vector IR must reproduce bit for bit."""
    out = row.astype(np.float32).reshape(-1, 32).copy()
    stride = 1
    while stride < 32:
        lanes = np.arange(32)
        low = lanes[(lanes & stride) == 0]
        a, b = out[:, low].copy(), out[:, low + stride].copy()
        out[:, low], out[:, low + stride] = a + b, a - b
        stride *= 2
    return (out * np.float32(1.0 / np.sqrt(32))).reshape(row.shape)


def test_the_vector_rotation_is_the_butterfly_bit_for_bit() -> None:
    from kvcache.attention import rotate_q8_groups

    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((64, 256)) * rng.choice([1e-3, 1.0, 1e3], size=(64, 256))).astype(np.float32)
    rows[3, 17] = 65000.0  # an outlier of a half float's range
    rows[4, :32] = 0.0
    for row in rows:
        rotated = row.copy()
        rotate_q8_groups(rotated, 256)
        np.testing.assert_array_equal(rotated, butterfly_reference(row))
    hadamard = np.array([[(-1) ** bin(i & j).count("1") for j in range(32)] for i in range(32)]) / np.sqrt(32)
    np.testing.assert_allclose(butterfly_reference(rows[0]).reshape(-1, 32), rows[0].reshape(-1, 32) @ hadamard,
                               rtol=1e-5, atol=1e-4)  # fmt: skip


def test_the_vector_rotation_refuses_a_strided_row() -> None:
    from numba import njit
    from numba.core.errors import TypingError

    from kvcache.hadamard_simd import hadamard32

    @njit
    def rotate_column(matrix):
        hadamard32(matrix[:, 0], 0)

    with pytest.raises(TypingError, match="C-contiguous float32 vector"):
        rotate_column(np.zeros((32, 2), dtype=np.float32))


_INT8_SCORES_SCRIPT = """
import sys, numpy as np
from tests.test_kvcache_attention import int8_attention_extremes
np.save(sys.argv[1], int8_attention_extremes())
"""


@njit(nogil=True)
def _fold_blocks_64_4(work, key_tiles, value_tiles, num_keys):  # type: ignore[no-untyped-def]
    for block in range(key_tiles.shape[1]):
        attend_heads(work, 0, 4, 64, key_tiles, value_tiles, block, 0, min(16, num_keys - 16 * block),
                     min(block + 1, key_tiles.shape[1] - 1), 0)  # fmt: skip


@njit(nogil=True)
def _fold_blocks_128_6(work, key_tiles, value_tiles, num_keys):  # type: ignore[no-untyped-def]
    for block in range(key_tiles.shape[1]):
        attend_heads(work, 0, 6, 128, key_tiles, value_tiles, block, 0, min(16, num_keys - 16 * block), -1, 0)


@njit(nogil=True)
def _fold_pairs_128_6(work, key_tiles, value_tiles, num_keys):  # type: ignore[no-untyped-def]
    """Blocks two a call, as the paged kernel folds an int8 cache's: (0, 1), (2, 3), ..., the last
    beside an empty one where their count is odd."""
    blocks = key_tiles.shape[1]
    for block in range(0, blocks, 2):
        second = min(block + 1, blocks - 1)
        second_keys = min(16, num_keys - 16 * second) if block + 1 < blocks else 0
        attend_heads(work, 0, 6, 128, key_tiles, value_tiles, (block, second), 0,
                     (min(16, num_keys - 16 * block), second_keys), (-1, second + 1), 0)  # fmt: skip


@njit(nogil=True)
def _fold_beside_empty_128_6(work, key_tiles, value_tiles, num_keys, empty_first):  # type: ignore[no-untyped-def]
    for block in range(key_tiles.shape[1]):
        keys = min(16, num_keys - 16 * block)
        counts = (0, keys) if empty_first else (keys, 0)
        attend_heads(work, 0, 6, 128, key_tiles, value_tiles, (block, block), 0, counts, (-1, -1), 0)


def int8_attention_extremes() -> np.ndarray:
    """An int8 cache's attention where its integer sums are largest: every key and value byte ±127,
    against queries whose int8 form is ±127 everywhere (and byte weights up to 255), then random
    keys, values and queries; every position of 40 over 16-key blocks, four heads of 64 a call one
    block a call, and six of 128 two blocks a call. The vector-IR calls are made directly, so a
    process compiles two of them, not the whole kernel's every head count."""
    rng = np.random.default_rng(5)
    results = []
    for head_dim, heads, fold in ((64, 4, _fold_blocks_64_4), (128, 6, _fold_pairs_128_6)):
        case = make_case(rng, [40], 16, heads, 1, head_dim, "int8")
        extreme = replace(case, queries=[np.sign(rng.standard_normal(case.queries[0].shape)).astype(np.float32)])
        extreme.key_cache = extreme.key_cache.copy()
        extreme.value_cache = extreme.value_cache.copy()
        tiles = extreme.key_cache[:, :, :head_dim, :]  # keys stored as k + 128 (k ^ -128 as int8)
        tiles[...] = np.where(rng.random(tiles.shape) < 0.5, -127, 127).astype(np.int8) ^ np.int8(-128)
        value_tiles = extreme.value_cache.reshape(*extreme.value_cache.shape[:2], -1)[..., : 16 * head_dim]
        value_tiles[...] = np.where(rng.random(value_tiles.shape) < 0.5, -127, 127).astype(np.int8)
        for source in (extreme, case):
            key_tiles = np.ascontiguousarray(source.key_cache[:1, source.block_tables[0]])
            value_tiles = np.ascontiguousarray(source.value_cache[:1, source.block_tables[0]])
            for position in range(40):
                work = attention_scratch(1, heads, 1, head_dim, 16, rows_together=1)[0]
                work[:, :head_dim] = source.queries[0][position] * np.float32(1 / np.sqrt(head_dim))
                work[:, 2 * head_dim + 16] = -np.inf
                for g in range(heads):
                    quantize_query_q8(work[g], head_dim, 2 * head_dim + 18)
                blocks = position // 16 + 1
                fold(work, np.ascontiguousarray(key_tiles[:, :blocks]), np.ascontiguousarray(value_tiles[:, :blocks]),
                     position + 1)  # fmt: skip
                results.append(work[:, head_dim : 2 * head_dim] / work[:, 2 * head_dim + 17 : 2 * head_dim + 18])
    return np.concatenate([r.ravel() for r in results])


def test_the_int8_attention_is_the_same_bits_with_or_without_vnni(tmp_path):
    """vpdpbusd and the plain vector IR compute an int8 cache's scores and value sums as the same
    integers, so attention's output does not depend on which the CPU runs. This process runs the best its CPU
    has; a second one, with a fresh kernel cache, the plain IR."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "plain.npy"
    env = {**os.environ, "TREADLE_NO_VNNI": "1", "TREADLE_NO_AVX2": "1", "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", _INT8_SCORES_SCRIPT, str(out)], check=True, env=env, timeout=600,
                   cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    ours = int8_attention_extremes()
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, np.load(out))


def test_an_int8_block_beside_an_empty_one_folds_as_it_does_alone() -> None:
    """The paged kernel pairs an int8 cache's blocks by position and sends a block without a partner
    (a row's last, a window's first) beside an empty one: its arithmetic is then the one-block
    call's, bit for bit, whichever side of the pair it is on."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [40], 16, 6, 1, 128, "int8")
    key_tiles = np.ascontiguousarray(case.key_cache[:1, case.block_tables[0][:3]])
    value_tiles = np.ascontiguousarray(case.value_cache[:1, case.block_tables[0][:3]])

    def folded(fold, *extra):  # type: ignore[no-untyped-def]
        work = attention_scratch(1, 6, 1, 128, 16, rows_together=1)[0]
        work[:, :128] = case.queries[0][39] * np.float32(1 / np.sqrt(128))
        work[:, 2 * 128 + 16] = -np.inf
        for g in range(6):
            quantize_query_q8(work[g], 128, 2 * 128 + 18)
        fold(work, key_tiles, value_tiles, 40, *extra)
        return work[:, 128:256] / work[:, 2 * 128 + 17 : 2 * 128 + 18]

    alone = folded(_fold_blocks_128_6)
    np.testing.assert_array_equal(folded(_fold_beside_empty_128_6, False), alone)
    np.testing.assert_array_equal(folded(_fold_beside_empty_128_6, True), alone)
    paired = folded(_fold_pairs_128_6)  # blocks 0 and 1 share their byte weights' scale: other bits
    assert not np.array_equal(paired, alone)
    np.testing.assert_allclose(paired, alone, rtol=0.02, atol=0.02)
