"""Paged attention and the KV write, as numba kernels run SPMD on the thread pool.

Both take `tid` / `nthreads` and do only their own share; the caller puts a barrier after each.
One layer's step is

    write_kv_rows(key, value, key_cache[layer], value_cache[layer], slot_mapping, tid, nthreads)
    barrier()
    paged_attention_rows(out, query, key_cache[layer], value_cache[layer], block_tables,
                         context_lens, query_start_loc, scratch, tid, nthreads)
    barrier()

One flat batch holds decodes (one query row) and prefill chunks (several) alike. The query rows of
sequence s are its last positions: row `query_start_loc[s] + i` sits at position
`context_lens[s] - query_len + i` and attends to positions 0..itself (or, on a sliding-window
layer, to the last `window` of them), so a chunk sees all earlier context and itself causally.

Work is split into items of up to `ROWS_TOGETHER` consecutive query rows of a sequence and one KV
head, dealt round-robin to threads; one item computes the outputs of every query head of that KV
head's group for its rows, reading each K/V tile once for all of them. The arithmetic of each row
depends only on that row, its sequence's KV and the block size: never on `nthreads`, on the other
rows of its item, on the other sequences in the batch, or on how the prompt was split into chunks (a
position's output is bit-identical whether it was a decode or a row of any prefill chunk). That is
what lets the engine promise outputs independent of batching, chunking, preemption and thread count.

The softmax is online (flash-attention's running max and sum, rescaled per block), so no buffer
scales with the context; per-thread scratch comes from `attention_scratch`, sized once.

With 16-key blocks and head_dim 64, 128 or 256 (the default shapes) each block is folded in by explicit
vector IR (`kvcache.attention_simd`), in calls of up to four heads of the GQA group (eight from an int8
cache); the loops below serve every other shape with the same semantics. With an int8 cache both paths
score the query quantized per group of 32 against the int8 keys in exact integers
(`quantize_query_q8`), as llama.cpp's q8_0 cache does, and sum the values the same way: per block and
group of 32, each key's softmax weight times its value scale becomes a byte (`_accumulate_values_q8`).
(What each path measures: docs/performance.md.)

fastmath stays off, so LLVM never reorders a sum. The kernels choose the order themselves: a score
adds eight head_dim terms at a time as a fixed tree, the value sum four keys at a time, because
numba leaves LLVM's SLP vectoriser off, fully unrolled 16-lane loops stay scalar, and a running sum
kept in memory waits on store-to-load forwarding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcache.attention_simd import (
    MAX_FLOAT_HEADS,
    MAX_INT8_HEADS,
    MAX_WIDE_INT8_HEADS,
    Q8_BACK,
    Q8_WEIGHT_FLOOR,
    SIMD_BLOCK_SIZE,
    WIDE_HEAD_DIM,
    attend_heads,
    byte_weight_floats,
    q8_dither,
    require_c_contiguous,
)
from kvcache.fastmath import (
    as_f32,
    exp_f32,
    f16_bits_to_f32,
    f32_to_f16_bits,
    flip_sign_bit,
    is_int8,
    like,
    round_half_away,
)
from kvcache.hadamard_simd import HADAMARD_SIZE, hadamard32
from kvcache.prefetch import prefetch_tile
from kvcache.storage import Q8_GROUP

assert Q8_GROUP == HADAMARD_SIZE, "a group's rotation is the 32-point transform"

# One query head's row of scratch: its scaled query, its output accumulator, one block's scores
# (then softmax weights), the running max and running sum of the online softmax, and (int8 caches)
# the query quantized like a key: head_dim int8 values, then per group its scale and -(128 · Σq) · scale;
# then (int8 caches) byte weights: the numba path's of one block's value group, the vector IR's of a
# call's two blocks.
_NUM_SOFTMAX_STATS = 2

# A sequence's KV (one layer, every KV head) up to this size stays in the last-level cache while a
# prefill chunk's rows read it one after another: half of the 32 MB L3 the prefetch was measured on
# (docs/performance.md, "Long contexts"), leaving room for everything else a step touches.
CACHED_KV_BYTES = 16 << 20
# how far ahead the vector IR asks for tiles (docs/performance.md, long contexts): an int8 call's two
# blocks ask for the pair this many blocks on, a float call's block for the one this many on
INT8_BLOCKS_AHEAD = 6
FLOAT_BLOCKS_AHEAD = 3
# A prefill chunk's consecutive query rows that walk their sequence's blocks together, each block read
# from L2 or L3 once for all of them rather than once a row (docs/performance.md, "Prompts: rows that
# read their keys together")
ROWS_TOGETHER = 8


@njit(nogil=True, cache=True, inline="always")
def query_q8_floats(head_dim: int) -> int:
    """float32 slots of a scratch row that hold the int8 query: its bytes, its scales, its offsets."""
    return head_dim // 4 + 2 * (head_dim // Q8_GROUP)


def attention_scratch(
    max_threads: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
    rows_together: int = ROWS_TOGETHER,
) -> np.ndarray:
    """Per-thread scratch for `paged_attention_rows`, allocated once at start.

    Shape (max_threads, rows_together · group_size, width) float32: a row per query head of a GQA group
    for each of the query rows an item takes together, width
    2 * head_dim + block_size + 2 + query_q8_floats + two blocks' byte weights (each the larger of
    block_size floats, the numba path's, and `attention_simd.byte_weight_floats`, the vector IR's).
    """
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads do not split into groups over {n_kv_heads} KV heads")
    byte_weights = max(block_size, byte_weight_floats(head_dim))
    width = 2 * head_dim + block_size + _NUM_SOFTMAX_STATS + query_q8_floats(head_dim) + 2 * byte_weights
    return np.zeros((max_threads, rows_together * (n_heads // n_kv_heads), width), dtype=np.float32)


@njit(nogil=True, cache=True, fastmath=False)
def write_kv_rows(key, value, key_cache, value_cache, slot_mapping, tid, nthreads):
    """Store this step's K and V rows at their slots (slot = block_id * block_size + offset).

    key, value:   (num_tokens, n_kv_heads, head_dim) float32
    key_cache:    (n_kv_heads, num_blocks, head_dim, block_size) float32, or uint16 half floats, one layer
    value_cache:  (n_kv_heads, num_blocks, block_size, head_dim) like key_cache, one layer
    slot_mapping: (num_tokens,) int32
    Rows are split into contiguous ranges, one per thread; every slot is written by one thread.
    """
    num_tokens = slot_mapping.shape[0]
    n_kv_heads = key.shape[1]
    head_dim = key.shape[2]
    block_size = value_cache.shape[2]
    begin = num_tokens * tid // nthreads
    end = num_tokens * (tid + 1) // nthreads
    element = key_cache[0, 0, 0, 0]  # its type picks the stored precision
    for token in range(begin, end):
        slot = slot_mapping[token]
        block_id = slot // block_size
        offset = slot - block_id * block_size
        for kv_head in range(n_kv_heads):
            if is_int8(element):
                _store_q8_key(key[token, kv_head], key_cache[kv_head, block_id], offset, head_dim)
                _store_q8_value(value[token, kv_head], value_cache[kv_head, block_id], offset, head_dim)
                continue
            for d in range(head_dim):
                key_cache[kv_head, block_id, d, offset] = like(key[token, kv_head, d], element)
            for d in range(head_dim):
                value_cache[kv_head, block_id, offset, d] = like(value[token, kv_head, d], element)


@njit(nogil=True, cache=True, fastmath=False)
def rotate_q8_groups(row, n):
    """An orthonormal Walsh-Hadamard transform of each Q8_GROUP values of row[0:n], in place.

    For an int8 cache the model step rotates queries and keys this way before the key is stored: q·k is
    unchanged, but a channel whose values dwarf the others' (RoPE'd keys have a few) is spread over its
    group instead of setting a scale that rounds the other 31 values to a few steps (QuaRot's idea).
    Measured on Qwen2.5-Coder-0.5B (docs/performance.md): top-1 agreement with a float32 cache 95% →
    97%; rotating whole heads, rotating values too, or groups of 16 did no better.
    """
    for first in range(0, n, Q8_GROUP):
        hadamard32(row, first)  # `row` a C-contiguous float32 vector, `n` a multiple of Q8_GROUP


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _q8_group_scale(x, first):
    """The fp16 bits of group `first`..`first + Q8_GROUP`'s scale, and the factor that quantizes it."""
    amax = np.float32(0.0)
    for d in range(first, first + Q8_GROUP):
        amax = max(amax, abs(x[d]))
    inverse = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    return f32_to_f16_bits(amax / np.float32(127.0)), inverse


@njit(nogil=True, cache=True, fastmath=False)
def _store_q8_key(x, tile, offset, head_dim):
    """Key `offset` of an int8 K tile: its values k as the unsigned bytes k + 128 (`vpdpbusd`'s
    unsigned operand), each quad of dimensions keeping its four bytes together (byte
    (d // 4)·4·block_size + 4·offset + d % 4), then its groups' fp16 scales in the (groups,
    block_size) array after all values."""
    block_size = tile.shape[1]
    flat = tile.reshape(-1)
    scales = flat[head_dim * block_size :].view(np.uint16)
    for g in range(head_dim // Q8_GROUP):
        scale_bits, inverse = _q8_group_scale(x, g * Q8_GROUP)
        for d in range(g * Q8_GROUP, (g + 1) * Q8_GROUP):
            k = np.int8(min(max(round_half_away(x[d] * inverse), -127), 127))
            flat[(d // 4) * 4 * block_size + 4 * offset + d % 4] = flip_sign_bit(k)
        scales[g * block_size + offset] = scale_bits


@njit(nogil=True, cache=True, fastmath=False)
def quantize_query_q8(work_row, head_dim, first):
    """The scaled query work_row[:head_dim] as int8 per group of Q8_GROUP (a key's rounding, a float32
    scale), stored from float slot `first` of the row: the bytes, the groups' scales, and each group's
    -(128 · Σq) · scale, which the vector IR's unsigned keys (k + 128) take back (computed once per
    query, not per block)."""
    q8 = work_row[first : first + head_dim // 4].view(np.int8)
    groups = head_dim // Q8_GROUP
    scales = work_row[first + head_dim // 4 : first + head_dim // 4 + groups]
    offsets = work_row[first + head_dim // 4 + groups : first + head_dim // 4 + 2 * groups]
    for g in range(groups):
        amax = np.float32(0.0)
        for d in range(g * Q8_GROUP, (g + 1) * Q8_GROUP):
            amax = max(amax, abs(work_row[d]))
        inverse = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for d in range(g * Q8_GROUP, (g + 1) * Q8_GROUP):
            q8[d] = min(max(round_half_away(work_row[d] * inverse), -127), 127)
            total += q8[d]
        scales[g] = amax / np.float32(127.0)
        offsets[g] = -(np.float32(128 * total) * scales[g])


@njit(nogil=True, cache=True, fastmath=False)
def _store_q8_value(x, tile, offset, head_dim):
    """Key `offset` of an int8 V tile: its values where each quad of keys keeps a dimension's four
    bytes together (byte (offset // 4)·4·head_dim + 4·d + offset % 4: what `vpdpbusd` multiplies),
    then its groups' fp16 scales in the (groups, block_size) array after all values."""
    block_size = tile.shape[0]
    flat = tile.reshape(-1)
    scales = flat[head_dim * block_size :].view(np.uint16)
    base = (offset // 4) * 4 * head_dim + offset % 4
    for g in range(head_dim // Q8_GROUP):
        scale_bits, inverse = _q8_group_scale(x, g * Q8_GROUP)
        for d in range(g * Q8_GROUP, (g + 1) * Q8_GROUP):
            flat[base + 4 * d] = min(max(round_half_away(x[d] * inverse), -127), 127)
        scales[g * block_size + offset] = scale_bits


@njit(nogil=True, cache=True, fastmath=False)
def paged_attention_rows(
    out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scratch, tid, nthreads,
    scale, window,
):  # fmt: skip
    """Causal grouped-query attention of every query row over its sequence's paged KV.

    out, query:      (num_tokens, n_heads, head_dim) float32; query head h reads KV head
                     h // (n_heads // n_kv_heads); scores are q·k · scale (1 / sqrt(head_dim) for most models);
                     out may be query itself (an item reads its query heads before it writes their outputs)
    window:          0, or the keys a position sees, itself included (sliding-window layers): position p
                     then attends to max(0, p - window + 1) .. p; blocks wholly before that are not read
    key_cache:       (n_kv_heads, num_blocks, head_dim, block_size) float32, or uint16 half floats
                     (read as float32: the arithmetic is the same for both), one layer
    value_cache:     (n_kv_heads, num_blocks, block_size, head_dim) like key_cache, one layer
    block_tables:    (num_seqs, max_blocks_per_seq) int32; only the first ceil(context_len / block_size)
                     entries of a row are read
    context_lens:    (num_seqs,) int32, this step's rows included
    query_start_loc: (num_seqs + 1,) int32; sequence s owns rows [query_start_loc[s], query_start_loc[s+1])
    scratch:         (nthreads or more, rows_together · group_size, ...) float32: `attention_scratch`'s;
                     an item takes up to rows_together consecutive rows of a prefill chunk
    The caches and scratch must be C-contiguous (the vector IR reads them by pointer): a view that
    is not is refused when the kernel is compiled.
    """
    require_c_contiguous(key_cache, value_cache, scratch)
    n_kv_heads = key_cache.shape[0]
    rows_together = max(1, scratch.shape[1] // (query.shape[1] // n_kv_heads))
    block_bytes = n_kv_heads * (key_cache[0, 0].size + value_cache[0, 0].size) * key_cache.itemsize
    work = scratch[tid]
    item = 0
    for seq in range(context_lens.shape[0]):
        block_table = block_tables[seq]
        row_begin = query_start_loc[seq]
        row_end = query_start_loc[seq + 1]
        first_position = context_lens[seq] - (row_end - row_begin)
        # A chunk's first item brings its sequence's tiles in; the items after it find them in L2 or L3,
        # where they come sooner without asking (the requests cost a fifth of a block's time), unless
        # the sequence's KV outgrows the cache.
        kv_bytes = -(-context_lens[seq] // key_cache.shape[3]) * block_bytes
        prefetch_every_item = kv_bytes > CACHED_KV_BYTES
        row = row_begin
        while row < row_end:
            rows = min(rows_together, row_end - row)
            position = first_position + (row - row_begin)
            for kv_head in range(n_kv_heads):
                # Round-robin over items balances the causal triangle of a prefill chunk.
                if item % nthreads == tid:
                    _attend_rows(out, query, key_cache, value_cache, block_table, row, rows, position, kv_head, work,
                                 scale, window, prefetch_every_item or row == row_begin)  # fmt: skip
                item += 1
            row += rows


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _blocks_ahead(block_table, logical_block, highest_block, quantized):
    """The blocks whose tiles a vector-IR call asks for while it folds `logical_block` (-1: none, past
    `highest_block`): an int8 call's pair INT8_BLOCKS_AHEAD on, a float call's block FLOAT_BLOCKS_AHEAD on."""
    if quantized:
        ahead = logical_block + INT8_BLOCKS_AHEAD
        return (block_table[ahead] if ahead <= highest_block else -1,
                block_table[ahead + 1] if ahead + 1 <= highest_block else -1)
    ahead = logical_block + FLOAT_BLOCKS_AHEAD
    return (block_table[ahead] if ahead <= highest_block else -1, -1)


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _starts_pair(logical_block, first_key, last_block, block_size, pairable):
    """Whether a row whose keys run first_key..(its position) folds `logical_block` together with the next:
    int8 vector-IR blocks of heads of 64 or 128 go two a call, paired by position (2k, 2k + 1), so that
    a row's calls, and so its rounding, depend on its position and window only; a block whose partner is
    not read (the last), or not read whole (the first of a window), goes with an empty one."""
    return (pairable and logical_block % 2 == 0 and logical_block < last_block
            and first_key <= logical_block * block_size)


@njit(nogil=True, cache=True, fastmath=False, inline="always")  # compiled once, in the kernel's body
def _attend_rows(out, query, key_cache, value_cache, block_table, first_row, rows, position, kv_head, work, scale,
                 window, prefetch):  # fmt: skip
    """Outputs of query rows first_row..first_row + rows (one sequence's, at positions position..) for the
    query heads of `kv_head`'s group.

    The rows walk the sequence's blocks together: a block (an int8 pair) that every row reads whole is
    folded for all of them in the same vector-IR calls, their query heads side by side, and the others
    (the causal edge, where a window opens) row by row, the block's tiles then in L1. One row at a time
    read a long prompt's KV from L2 or L3 again for every row, in calls of three heads where they now
    take four (int8: eight). Each row's arithmetic is its own and in its own order (its blocks ascending,
    each folded as when the row is alone: a head's arithmetic does not depend on the call's other
    heads), so its output is the same bits whichever rows share its item.

    work: one thread's `attention_scratch`; row r · group_size + g serves query head
    kv_head * group_size + g of query row first_row + r and holds [scaled query | output accumulator |
    one block's scores, then weights | running max, running sum | with an int8 cache, the int8 query and
    the byte weights of a block (numba path) or of a call's two blocks (vector IR)].
    The vector IR (16-key blocks of head_dim 64, 128 or 256) reads a block's tiles by (cache, KV head,
    block), not through views, whose references to the cache are taken and dropped by atomic
    operations; from an int8 cache it folds two blocks a call (heads of 64 and 128). It asks for
    later blocks' tiles a line per step of its loops, in the call of the first row that reads a block.
    (The same requests issued back to back before the call left a 32k context's attention ~40% slower
    from DRAM on a Zen 4 guest, int8 or float16: a burst the kernel's own loads wait behind.) The numba
    path's inner loops run over unit-stride 1-D views with a plain loop index, so numba proves the
    indices non-negative and vectorises.
    """
    head_dim = query.shape[2]
    block_size = value_cache.shape[2]
    group_size = query.shape[1] // key_cache.shape[0]
    quantized = is_int8(key_cache[0, 0, 0, 0])
    first_head = kv_head * group_size
    acc_begin, weights_begin, stats_begin = head_dim, 2 * head_dim, 2 * head_dim + block_size
    q8_begin = stats_begin + 2
    byte_weights_begin = q8_begin + query_q8_floats(head_dim)
    scale = np.float32(scale)
    for r in range(rows):
        for g in range(group_size):
            work_row = work[r * group_size + g]
            q = query[first_row + r, first_head + g]
            for d in range(head_dim):
                work_row[d] = q[d] * scale
                work_row[acc_begin + d] = 0.0
            work_row[stats_begin] = -np.inf  # running max
            work_row[stats_begin + 1] = 0.0  # running sum of exp(score - running max)
            if quantized:  # an int8 cache's scores are int8 dot products, as llama.cpp's q8_0 cache's
                quantize_query_q8(work_row, head_dim, q8_begin)

    # The vector IR's blocks are asked for from its own loops (`attend_heads`), a line a step: an int8
    # block's two tiles (68 lines) three pairs of blocks ahead, a float block's (128-256 lines) three
    # blocks ahead. The numba path's are asked for here, through views, in a burst: a float block's
    # twice, four blocks ahead and then two, the second request catching what the first lost (asked
    # once, float16 attention from DRAM ran 25-30% slower); an int8 block's once, three ahead.
    first_ahead, last_ahead, ahead_step = (3, 3, 1) if quantized else (2, 4, 2)
    vector_ir = block_size == SIMD_BLOCK_SIZE and (head_dim == 64 or head_dim == 128 or head_dim == WIDE_HEAD_DIM)
    pairable = quantized and vector_ir and head_dim != WIDE_HEAD_DIM
    last_position = position + rows - 1
    highest_block = last_position // block_size
    lowest_key = max(0, position - window + 1) if window > 0 else 0
    highest_first_key = max(0, last_position - window + 1) if window > 0 else 0
    for logical_block in range(lowest_key // block_size, highest_block + 1):
        block_id = block_table[logical_block]
        asked = not prefetch  # later blocks are asked for by the first row that reads this one
        # A block (an int8 pair) that every row reads whole is folded for all of them at once: their
        # heads side by side in calls of as many as fit, each head's arithmetic its own.
        span = 2 if pairable else 1
        if (vector_ir and rows > 1 and logical_block % span == 0 and logical_block * block_size >= highest_first_key
                and (logical_block + span) * block_size <= position + 1):
            ahead_ids = _blocks_ahead(block_table, logical_block, highest_block, quantized) if prefetch else (-1, -1)
            second_id = block_table[logical_block + 1] if pairable else block_id
            second_keys = block_size if pairable else 0
            total = rows * group_size
            h = 0
            while h < total:
                heads = _heads_in_next_call(total - h, quantized, head_dim)
                attend_heads(work, h, heads, head_dim, key_cache, value_cache, (block_id, second_id), kv_head,
                             (block_size, second_keys), ahead_ids, 0)  # fmt: skip
                h += heads
            continue
        for r in range(rows):
            row_position = position + r
            last_block = row_position // block_size
            first_key = max(0, row_position - window + 1) if window > 0 else 0
            first_block = first_key // block_size
            if logical_block < first_block or logical_block > last_block:
                continue  # outside this row's window, or after its position
            if (logical_block % 2 == 1 and logical_block - 1 >= first_block
                    and _starts_pair(logical_block - 1, first_key, last_block, block_size, pairable)):
                continue  # folded with the block before it
            num_keys = min(block_size, row_position + 1 - logical_block * block_size)  # causal in its last block
            skipped = max(0, first_key - logical_block * block_size)  # keys before the window, in its first block
            # Other blocks than int8 pairs go alone, heads of 256 too (`attention_simd.WIDE_HEAD_DIM` says why).
            paired = _starts_pair(logical_block, first_key, last_block, block_size, pairable)
            second_id = block_table[logical_block + 1] if paired else block_id
            second_keys = min(block_size, row_position + 1 - (logical_block + 1) * block_size) if paired else 0
            ahead_ids = (-1, -1)  # later blocks' tiles travel from DRAM into L2 while this one is computed
            if not asked and vector_ir:  # asked for from the vector IR's loops
                ahead_ids = _blocks_ahead(block_table, logical_block, highest_block, quantized)
            elif not asked:
                for ahead in range(first_ahead, last_ahead + 1, ahead_step):
                    if logical_block + ahead <= highest_block:
                        next_block_id = block_table[logical_block + ahead]
                        prefetch_tile(key_cache[kv_head, next_block_id])
                        prefetch_tile(value_cache[kv_head, next_block_id])
            asked = True
            if vector_ir:
                g = 0
                while g < group_size:
                    heads = _heads_in_next_call(group_size - g, quantized, head_dim)
                    # a group served in two calls asks twice: a float block's 128-256 requests are not all
                    # kept from one pass
                    attend_heads(work, r * group_size + g, heads, head_dim, key_cache, value_cache,
                                 (block_id, second_id), kv_head, (num_keys, second_keys), ahead_ids,
                                 skipped)  # fmt: skip
                    g += heads
                continue
            keys = key_cache[kv_head, block_id]  # (head_dim, block_size)
            values = value_cache[kv_head, block_id]  # (block_size, head_dim)
            for g in range(group_size):
                work_row = work[r * group_size + g]
                acc = work_row[acc_begin:weights_begin]
                weights = work_row[weights_begin:stats_begin]
                # where the window opens inside this block, only its later keys count
                if quantized:
                    _block_scores_q8(weights, keys, work_row[q8_begin:], skipped, num_keys - skipped, head_dim)
                elif skipped > 0:
                    _block_scores(weights, keys[:, skipped:], work_row[:acc_begin], num_keys - skipped)
                else:
                    _block_scores(weights, keys, work_row[:acc_begin], num_keys)
                correction = _softmax_block_update(weights, num_keys - skipped, work_row[stats_begin:])
                if correction != 1.0:
                    for d in range(head_dim):
                        acc[d] *= correction
                if quantized:
                    _accumulate_values_q8(acc, values, weights, work_row[byte_weights_begin:], skipped,
                                          num_keys - skipped, head_dim)  # fmt: skip
                elif skipped > 0:
                    _accumulate_values(acc, values[skipped:], weights, num_keys - skipped)
                else:
                    _accumulate_values(acc, values, weights, num_keys)

    for r in range(rows):
        for g in range(group_size):
            work_row = work[r * group_size + g]
            inv_sum = np.float32(1.0) / work_row[stats_begin + 1]
            out_row = out[first_row + r, first_head + g]
            for d in range(head_dim):
                out_row[d] = work_row[acc_begin + d] * inv_sum


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _heads_in_next_call(remaining, quantized, head_dim):
    """How many of a group's `remaining` query heads the next vector-IR call serves: as many as fit the
    registers (`attention_simd.MAX_FLOAT_HEADS`, `MAX_INT8_HEADS`; `MAX_WIDE_INT8_HEADS` for heads
    of 256). A float cache's group of 6, 7 or 8 heads (Qwen2.5's 1.5B, 7B and 3B) reads and widens
    each K/V row twice, an int8 cache's once. A head's arithmetic is the same in a call of any size,
    so how a group is cut changes no output."""
    if quantized:
        return min(remaining, MAX_WIDE_INT8_HEADS if head_dim == WIDE_HEAD_DIM else MAX_INT8_HEADS)
    if remaining <= MAX_FLOAT_HEADS:
        return remaining
    return 3 if remaining < 7 else 4  # 5 → 3 + 2, 6 → 3 + 3, 7 → 4 + 3, 8 → 4 + 4: never one head


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _block_scores(scores, keys, q_scaled, num_keys):
    """scores[t] = sum over d of q_scaled[d] * keys[d, t], for the block's first num_keys keys.

    Eight rows of the transposed tile per pass, added as a fixed tree: eight times fewer trips of
    the running scores through memory than one row at a time, the same sum for every caller.
    """
    head_dim = keys.shape[0]
    for t in range(num_keys):
        scores[t] = 0.0
    d = 0
    while d + 8 <= head_dim:
        q0, q1, q2, q3 = q_scaled[d], q_scaled[d + 1], q_scaled[d + 2], q_scaled[d + 3]
        q4, q5, q6, q7 = q_scaled[d + 4], q_scaled[d + 5], q_scaled[d + 6], q_scaled[d + 7]
        k0, k1, k2, k3 = keys[d], keys[d + 1], keys[d + 2], keys[d + 3]
        k4, k5, k6, k7 = keys[d + 4], keys[d + 5], keys[d + 6], keys[d + 7]
        for t in range(num_keys):
            scores[t] += (
                (q0 * as_f32(k0[t]) + q1 * as_f32(k1[t])) + (q2 * as_f32(k2[t]) + q3 * as_f32(k3[t]))
            ) + ((q4 * as_f32(k4[t]) + q5 * as_f32(k5[t])) + (q6 * as_f32(k6[t]) + q7 * as_f32(k7[t])))
        d += 8
    while d < head_dim:  # head_dim not a multiple of 8
        q_d = q_scaled[d]
        k_d = keys[d]
        for t in range(num_keys):
            scores[t] += q_d * as_f32(k_d[t])
        d += 1


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _softmax_block_update(scores, num_keys, stats):
    """Turn one block's scores into exp(score - new max), in place; fold them into the running sum.

    Returns the factor exp(old max - new max) by which everything accumulated so far must shrink
    (0 for the first block, whose old max is -inf).
    """
    block_max = scores[0]
    for t in range(1, num_keys):
        block_max = max(block_max, scores[t])
    new_max = max(stats[0], block_max)
    correction = exp_f32(stats[0] - new_max)
    for t in range(num_keys):  # vectorised: exp_f32 is plain arithmetic
        scores[t] = exp_f32(scores[t] - new_max)
    block_sum = np.float32(0.0)
    for t in range(num_keys):  # a sequential sum: its order is fixed, whatever the batch
        block_sum += scores[t]
    stats[0] = new_max
    stats[1] = stats[1] * correction + block_sum
    return correction


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _accumulate_values(acc, values, weights, num_keys):
    """acc += sum over t of weights[t] * values[t], four value rows per pass in a fixed tree."""
    head_dim = values.shape[1]
    t = 0
    while t + 4 <= num_keys:
        w0, w1, w2, w3 = weights[t], weights[t + 1], weights[t + 2], weights[t + 3]
        v0, v1, v2, v3 = values[t], values[t + 1], values[t + 2], values[t + 3]
        for d in range(head_dim):
            acc[d] += (w0 * as_f32(v0[d]) + w1 * as_f32(v1[d])) + (w2 * as_f32(v2[d]) + w3 * as_f32(v3[d]))
        t += 4
    while t < num_keys:
        w = weights[t]
        v = values[t]
        for d in range(head_dim):
            acc[d] += w * as_f32(v[d])
        t += 1


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _block_scores_q8(scores, tile, query_q8, first, num_keys, head_dim):
    """`_block_scores` over an int8 K tile (`_store_q8_key`'s layout) with the int8 query
    (`quantize_query_q8`'s, from query_q8[0]), keys first..first + num_keys into scores[0..num_keys):
    per key, each group's integer q·k times the query's and the key's scales, groups added in order."""
    block_size = tile.shape[1]
    groups = head_dim // Q8_GROUP
    flat = tile.reshape(-1)
    scales = flat[head_dim * block_size :].view(np.uint16)
    q8 = query_q8[: head_dim // 4].view(np.int8)
    q_scales = query_q8[head_dim // 4 : head_dim // 4 + groups]
    for t in range(num_keys):
        key = first + t
        total = np.float32(0.0)
        for g in range(groups):
            group_sum = 0
            for d in range(g * Q8_GROUP, (g + 1) * Q8_GROUP):
                k = flip_sign_bit(flat[(d // 4) * 4 * block_size + 4 * key + d % 4])
                group_sum += np.int32(q8[d]) * np.int32(k)
            total += np.float32(group_sum) * q_scales[g] * f16_bits_to_f32(scales[g * block_size + key])
        scores[t] = total


@njit(nogil=True, cache=True, fastmath=False, inline="always")
def _accumulate_values_q8(acc, tile, weights, byte_weights, first, num_keys, head_dim):
    """`_accumulate_values` over an int8 V tile (`_store_q8_value`'s layout), keys first..first +
    num_keys weighted by weights[0..num_keys), as exact integer sums: per group of Q8_GROUP, each
    key's weight and value scale become one byte against the largest of each (W, S), kept in
    byte_weights[0..num_keys) (scratch), and acc += Σ byte · value times W · S / 255 (the vector
    IR's `_accumulate_q8` arithmetic)."""
    block_size = tile.shape[0]
    flat = tile.reshape(-1)
    scales = flat[head_dim * block_size :].view(np.uint16)
    top_weight = np.float32(0.0)
    for t in range(num_keys):
        top_weight = max(top_weight, weights[t])
    to_bytes = np.float32(255.0) / top_weight if top_weight > np.float32(Q8_WEIGHT_FLOOR) else np.float32(0.0)
    for g in range(head_dim // Q8_GROUP):
        group_scales = scales[g * block_size + first : g * block_size + first + num_keys]
        top_scale = np.float32(0.0)
        for t in range(num_keys):
            top_scale = max(top_scale, f16_bits_to_f32(group_scales[t]))
        inverse = np.float32(1.0) / top_scale if top_scale > 0 else np.float32(0.0)
        for t in range(num_keys):
            scaled = (weights[t] * to_bytes) * (f16_bits_to_f32(group_scales[t]) * inverse)
            byte_weights[t] = np.int32(min(scaled + np.float32(q8_dither(first + t, g)), np.float32(255.0)))
        back = top_weight * top_scale * np.float32(Q8_BACK)
        for d in range(g * Q8_GROUP, (g + 1) * Q8_GROUP):
            dot = 0
            for t in range(num_keys):
                key = first + t
                dot += np.int32(byte_weights[t]) * np.int32(flat[(key // 4) * 4 * head_dim + 4 * d + key % 4])
            acc[d] += np.float32(dot) * back
