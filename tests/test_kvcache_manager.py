"""The block manager as the scheduler uses it: prefix hits, eviction order, copy-on-write, refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcache.attention import attention_scratch, paged_attention_rows, write_kv_rows
from kvcache.batch import build_batch_arrays
from kvcache.block_pool import ROOT_HASH, hash_block
from kvcache.errors import CacheTooSmall, KVCacheError, OutOfBlocks, SequenceTooLong
from kvcache.manager import KVCacheManager
from kvcache.storage import KVCacheSpec, KVCacheStorage

BLOCK_SIZE = 4


def computed_sequence(kv: KVCacheManager, seq_id: int, token_ids: list[int]) -> int:
    """Allocate and run a prompt in one chunk plus one decode step, so every full block is published."""
    num_cached = kv.allocate(seq_id, token_ids[:-1])
    kv.append_slots(seq_id, token_ids[num_cached:-1])
    kv.append_slots(seq_id, token_ids[-1:])  # the next step shows the prompt's step ran
    return num_cached


def test_second_request_with_the_same_prompt_reuses_its_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    computed_sequence(kv, 1, [*prompt, 7])
    assert kv.can_allocate(prompt)
    assert kv.allocate(2, prompt) == 8
    assert kv.block_table(2)[:2].tolist() == kv.block_table(1)[:2].tolist()
    assert kv.block_table(2)[2] != kv.block_table(1)[2]  # the partial block is never shared
    assert [kv.pool.ref_count(int(b)) for b in kv.block_table(2)] == [2, 2, 1]
    assert (kv.stats.num_query_tokens, kv.stats.num_hit_tokens) == (11 + 11, 8)


def test_a_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(8))  # exactly two blocks
    computed_sequence(kv, 1, [*prompt, 9])
    kv.free(1)
    # Both blocks are cached, but the last prompt token must run to give logits: the second block
    # is recomputed into a fresh block rather than written inside the cached one.
    assert kv.allocate(2, prompt) == 4


def test_blocks_of_a_freed_sequence_stay_cached_and_are_found_again() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(13))
    computed_sequence(kv, 1, prompt)
    kv.free(1)
    assert (kv.num_used_blocks, kv.num_cached_blocks, kv.num_free_blocks) == (0, 3, 5)
    assert kv.allocate(2, prompt) == 12
    assert kv.num_cached_blocks == 0


def test_preempted_sequence_recomputes_only_what_was_evicted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(6))
    kv.allocate(1, prompt)
    kv.append_slots(1, prompt)
    generated = [50, 51, 52, 53, 54]
    for token_id in generated:  # each decode step appends the token sampled by the previous one
        kv.append_slots(1, [token_id])
    kv.free(1)  # preempted: its blocks go to the cache
    # Re-admitted with every token it has, sampled ones included.
    assert kv.allocate(1, prompt + generated + [55]) == 8


def test_generated_tokens_become_a_reusable_prefix_for_the_next_chat_turn() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    turn_1 = [1, 2, 3, 4, 5]
    answer = [60, 61, 62, 63, 64, 65, 66]
    kv.allocate(1, turn_1)
    kv.append_slots(1, turn_1)
    for token_id in answer:
        kv.append_slots(1, [token_id])
    kv.free(1)
    turn_2 = turn_1 + answer + [9, 9, 9]  # the client resends the conversation with a new message
    assert kv.allocate(2, turn_2) == 12


def test_free_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=64)
    cached_prompt = list(range(9))
    computed_sequence(kv, 1, cached_prompt)
    kv.free(1)
    assert (kv.num_cached_blocks, kv.num_free_blocks) == (2, 6)
    kv.allocate(2, [7] * 17)  # five blocks, all fresh
    assert kv.num_cached_blocks == 2
    assert kv.allocate(3, cached_prompt) == 8


def num_indexed_prefix_blocks(kv: KVCacheManager, token_ids: list[int]) -> int:
    """How many leading full blocks of token_ids the prefix index still holds."""
    block_hash = ROOT_HASH
    for num_blocks in range(len(token_ids) // BLOCK_SIZE):
        block_hash = hash_block(
            block_hash, token_ids[num_blocks * BLOCK_SIZE : (num_blocks + 1) * BLOCK_SIZE]
        )
        if kv.pool.lookup(block_hash) is None:
            return num_blocks
    return len(token_ids) // BLOCK_SIZE


def test_eviction_takes_the_least_recently_freed_blocks_tail_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, max_model_len=64)
    older = [1] * 12  # three full blocks
    newer = [2] * 12
    for seq_id, prompt in ((1, older), (2, newer)):
        kv.allocate(seq_id, prompt)
        kv.append_slots(seq_id, prompt)
        kv.free(seq_id)
    assert kv.num_cached_blocks == 6
    kv.allocate(3, [3] * 4)  # needs one block: evicts the older prefix's last block
    assert (num_indexed_prefix_blocks(kv, older), num_indexed_prefix_blocks(kv, newer)) == (2, 3)
    kv.allocate(4, [4] * 4)  # and then its middle block
    assert (num_indexed_prefix_blocks(kv, older), num_indexed_prefix_blocks(kv, newer)) == (1, 3)
    kv.free(3)  # an unhashed block goes back to the free list, not into the cache
    kv.allocate(5, [5] * 4)
    assert (num_indexed_prefix_blocks(kv, older), num_indexed_prefix_blocks(kv, newer)) == (1, 3)


def test_a_prefix_hit_makes_a_cached_block_recently_used_again() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=64)
    older, newer = [1] * 4, [2] * 4
    for seq_id, prompt in ((1, older), (2, newer)):
        kv.allocate(seq_id, prompt)
        kv.append_slots(seq_id, prompt)
        kv.free(seq_id)
    assert kv.allocate(3, [*older, 0]) == 4  # revives the older block...
    kv.free(3)  # ...and releases it after the newer one
    kv.allocate(4, [9] * 12)  # two free blocks, then one eviction: the newer block goes first
    assert (num_indexed_prefix_blocks(kv, older), num_indexed_prefix_blocks(kv, newer)) == (1, 0)


def test_prefix_hit_counts_toward_can_allocate() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, max_model_len=64)
    shared = list(range(8))
    computed_sequence(kv, 1, [*shared, 0])  # holds three blocks, two of them full and published
    prompt = [*shared, 40, 41, 42, 43, 44, 45]  # four blocks, two of them cached
    assert kv.num_free_blocks == 3
    assert kv.can_allocate(prompt)
    assert not kv.can_allocate([9] * 14)  # the same size without the shared prefix does not fit


def test_reviving_a_cached_block_uses_up_room() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=64)
    computed_sequence(kv, 1, list(range(9)))  # three blocks, the two full ones published
    kv.free(1)
    kv.allocate(2, [5] * 9)  # three blocks: both free ones, then the least recently used cached one
    assert (kv.num_cached_blocks, kv.num_free_blocks) == (1, 0)
    # One cached hit plus one new block: two, and only one (the hit itself) is available.
    assert not kv.can_allocate([0, 1, 2, 3, 8])
    assert kv.can_allocate([0, 1, 2, 3])  # a single block: the hit is capped, one new block


def test_fork_shares_every_block_and_copies_a_shared_partial_block_before_writing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(6))
    kv.allocate(1, prompt)
    kv.append_slots(1, prompt)
    kv.fork(1, 2)
    parent_blocks = kv.block_table(1).tolist()
    assert kv.block_table(2).tolist() == parent_blocks
    assert all(kv.pool.ref_count(b) == 2 for b in parent_blocks)
    assert kv.can_append(2)
    copies = kv.append_slots(2, [70])
    private_block = int(kv.block_table(2)[1])
    assert copies == [(parent_blocks[1], private_block)]
    assert kv.block_table(2)[0] == parent_blocks[0]  # the full block stays shared
    assert kv.append_slots(1, [80]) == []  # the parent is now the only holder of its partial block
    assert kv.block_table(1).tolist() == parent_blocks


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=64)
    kv.allocate(1, list(range(8)))
    kv.append_slots(1, list(range(8)))
    kv.fork(1, 2)
    assert kv.append_slots(1, [5]) == []
    assert kv.append_slots(2, [6]) == []
    assert kv.block_table(1)[2] != kv.block_table(2)[2]


def test_can_append_counts_the_copy_a_shared_block_needs() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE, max_model_len=8)
    kv.allocate(1, [1, 2])
    kv.append_slots(1, [1, 2])
    kv.fork(1, 2)
    kv.allocate(3, [3])  # takes the last free block
    assert not kv.can_append(2)
    with pytest.raises(OutOfBlocks):
        kv.append_slots(2, [4])


def test_too_long_and_too_large_requests_are_refused_with_distinct_errors() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=32)
    with pytest.raises(SequenceTooLong):
        kv.can_allocate([0] * 33)
    with pytest.raises(CacheTooSmall):
        kv.can_allocate([0] * 17)  # fits the context, never the cache
    with pytest.raises(CacheTooSmall):
        kv.allocate(1, [0] * 17)
    kv.allocate(1, [0] * 16)
    kv.append_slots(1, [0] * 16)
    with pytest.raises(CacheTooSmall):
        kv.can_append(1)  # a 17th token could never be held
    assert issubclass(SequenceTooLong, KVCacheError) and issubclass(CacheTooSmall, KVCacheError)
    assert issubclass(KVCacheError, ValueError)

    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=32)
    kv.allocate(1, [0] * 31)
    kv.append_slots(1, [0] * 31)
    kv.append_slots(1, [0])
    with pytest.raises(SequenceTooLong):
        kv.append_slots(1, [0])


def test_not_fitting_now_is_false_not_an_error() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=32)
    kv.allocate(1, [0] * 9)
    assert not kv.can_allocate([1] * 8)
    with pytest.raises(OutOfBlocks):
        kv.allocate(2, [1] * 8)
    kv.free(1)
    assert kv.can_allocate([1] * 8)


def test_misuse_is_refused() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=32)
    kv.allocate(1, [0])
    with pytest.raises(KVCacheError):
        kv.allocate(1, [0])
    with pytest.raises(KVCacheError):
        kv.allocate(2, [])
    with pytest.raises(KVCacheError):
        kv.fork(1, 1)
    kv.free(1)
    with pytest.raises(KeyError):
        kv.free(1)
    assert kv.num_used_blocks == 0


def test_prefix_caching_disabled_never_hits_and_keeps_nothing_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=64, enable_prefix_caching=False)
    prompt = list(range(10))
    computed_sequence(kv, 1, prompt)
    kv.free(1)
    assert kv.num_cached_blocks == 0
    assert kv.allocate(2, prompt) == 0


def test_block_hash_chains_over_the_whole_prefix() -> None:
    first = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(ROOT_HASH, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == first
    assert len(first) == 16


def test_batch_arrays_map_each_new_token_to_its_slot() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    kv.allocate(1, list(range(10)))
    kv.append_slots(1, list(range(6)))  # a first prefill chunk
    kv.allocate(2, [5, 5, 5])
    kv.append_slots(2, [5, 5, 5])
    kv.append_slots(2, [6])  # then a decode
    kv.append_slots(1, list(range(6, 10)))  # and the rest of the prompt
    arrays = build_batch_arrays(kv, [2, 1], [1, 4])
    table_1, table_2 = kv.block_table(1).tolist(), kv.block_table(2).tolist()
    assert arrays.context_lens.tolist() == [4, 10]
    assert arrays.query_start_loc.tolist() == [0, 1, 5]
    assert arrays.positions.tolist() == [3, 6, 7, 8, 9]
    expected_slots = [table_2[0] * 4 + 3] + [table_1[p // 4] * 4 + p % 4 for p in (6, 7, 8, 9)]
    assert arrays.slot_mapping.tolist() == expected_slots
    assert arrays.block_tables.shape == (2, 3)  # as wide as the widest table
    assert arrays.block_tables[0].tolist() == [*table_2, 0, 0]
    assert all(a.dtype == np.int32 for a in (arrays.block_tables, arrays.context_lens, arrays.slot_mapping))


def test_manager_storage_and_kernels_together_equal_dense_attention() -> None:
    """A prompt computed in chunks after a prefix hit, then decoded, through the real arrays."""
    rng = np.random.default_rng(7)
    spec = KVCacheSpec(n_layers=1, n_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE)
    storage = KVCacheStorage.allocate(spec, num_blocks=16)
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    n_heads, context_len = 4, 23
    keys = rng.standard_normal((context_len, 2, 16), dtype=np.float32)  # K, V, Q of each position
    values = rng.standard_normal((context_len, 2, 16), dtype=np.float32)
    queries = rng.standard_normal((context_len, n_heads, 16), dtype=np.float32)
    token_ids = list(range(context_len))
    out = np.zeros_like(queries)
    scratch = attention_scratch(2, n_heads, 2, 16, BLOCK_SIZE)

    def run_step(seq_id: int, start: int, end: int) -> None:
        storage.copy_blocks(kv.append_slots(seq_id, token_ids[start:end]))
        arrays = build_batch_arrays(kv, [seq_id], [end - start])
        for tid in range(2):
            write_kv_rows(
                keys[start:end],
                values[start:end],
                storage.key_cache[0],
                storage.value_cache[0],
                arrays.slot_mapping,
                tid,
                2,
            )
        for tid in range(2):
            paged_attention_rows(
                out[start:end],
                queries[start:end],
                storage.key_cache[0],
                storage.value_cache[0],
                arrays.block_tables,
                arrays.context_lens,
                arrays.query_start_loc,
                scratch,
                tid,
                2,
                np.float32(1.0 / np.sqrt(queries.shape[-1])),  # the step's type: no second compile
                0,
            )

    kv.allocate(1, token_ids[:10])
    run_step(1, 0, 10)
    run_step(1, 10, 11)
    kv.free(1)
    num_cached = kv.allocate(2, token_ids[:20])
    assert num_cached == 8
    out[:] = np.nan
    run_step(2, 8, 15)
    run_step(2, 15, 20)
    kv.fork(2, 3)  # the copy-on-write block must carry the shared positions' KV along
    for position in range(20, context_len):
        run_step(3, position, position + 1)
    for position in range(8, context_len):
        k = keys[: position + 1].astype(np.float64)
        v = values[: position + 1].astype(np.float64)
        for head in range(n_heads):
            scores = k[:, head // 2] @ queries[position, head] / 4.0
            weights = np.exp(scores - scores.max())
            expected = weights @ v[:, head // 2] / weights.sum()
            np.testing.assert_allclose(out[position, head], expected, rtol=1e-5, atol=1e-5)


def test_storage_is_sized_from_the_budget_and_copies_blocks_on_every_layer() -> None:
    spec = KVCacheSpec()  # the default model: 30 layers, 3 KV heads of 64, blocks of 16 tokens
    assert spec.bytes_per_token == 46_080
    assert KVCacheSpec(dtype="float16").bytes_per_token == 23_040
    assert KVCacheSpec(dtype="int8").bytes_per_token == 12_240  # 64 int8 values and 2 fp16 scales per row
    with pytest.raises(KVCacheError, match="float16"):
        KVCacheSpec(dtype="bfloat16")
    with pytest.raises(KVCacheError, match="multiple of 32"):
        KVCacheSpec(dtype="int8", head_dim=48)
    with pytest.raises(KVCacheError, match="multiple of 4, got 6"):
        KVCacheSpec(dtype="int8", block_size=6)
    assert spec.num_blocks_for_mib(1024) == 1456
    with pytest.raises(KVCacheError):
        spec.num_blocks_for_mib(0.5)
    storage = KVCacheStorage.allocate(KVCacheSpec(n_layers=2, n_kv_heads=1, head_dim=4, block_size=2), 3)
    assert storage.key_cache.shape == (2, 1, 3, 4, 2) and storage.value_cache.shape == (2, 1, 3, 2, 4)
    storage.key_cache[:, :, 1] = 5.0
    storage.value_cache[:, :, 1] = 6.0
    storage.copy_blocks([(1, 2)])
    assert (storage.key_cache[:, :, 2] == 5.0).all() and (storage.value_cache[:, :, 2] == 6.0).all()
    assert (storage.key_cache[:, :, 0] == 0.0).all()


_ALLOCATE = """
import sys
import numpy as np
from kvcache.storage import KVCacheSpec, KVCacheStorage

def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

spec = KVCacheSpec(dtype=sys.argv[1])
before = resident_bytes()
storage = KVCacheStorage.allocate(spec, spec.num_blocks_for_mib(64))
grown = resident_bytes() - before
nonzero = storage.key_cache.any() or storage.value_cache.any()
print(grown / (storage.key_cache.nbytes + storage.value_cache.nbytes), nonzero)
"""


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_allocate_touches_every_page_at_start_and_zeroes_both_caches(dtype: str) -> None:
    """Every page is resident once allocated, so no step pays the cache's page faults. Checked in a fresh
    process, where the arrays cannot reuse pages an earlier test already touched."""
    result = subprocess.run([sys.executable, "-c", _ALLOCATE, dtype], cwd=Path(__file__).resolve().parent.parent,
                            capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    resident_share, nonzero = result.stdout.split()
    assert float(resident_share) >= 0.95 and nonzero == "False"


def test_a_failed_step_publishes_none_of_the_blocks_it_was_to_fill() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(100, 113))  # three full blocks and one token
    kv.allocate(1, prompt)
    kv.append_slots(1, prompt[:8])  # step 1 ran: its two blocks are proven once step 2 appends
    kv.append_slots(1, prompt[8:])  # step 2 fails before writing its KV
    kv.free(1, latest_step_ran=False)
    # Only step 1's blocks are reusable; the block step 2 was to fill holds whatever was there before.
    assert num_indexed_prefix_blocks(kv, prompt) == 2
    assert kv.allocate(2, prompt) == 8
    assert kv.num_used_blocks == 4


def test_a_sequence_failing_in_its_first_step_leaves_nothing_in_the_prefix_index() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64)
    prompt = list(range(100, 113))
    kv.allocate(1, prompt)
    kv.append_slots(1, prompt)
    kv.free(1, latest_step_ran=False)
    assert num_indexed_prefix_blocks(kv, prompt) == 0
    assert (kv.num_used_blocks, kv.num_cached_blocks) == (0, 0)
    assert kv.allocate(2, prompt) == 0
