"""Block-manager invariants under random allocate / append / speculate-and-roll-back / fork / free /
prefix-reuse sequences.

A shadow KV cache records, for every slot, which (position, token) was last written there. A
sequence "reads" its context through its block table; if a block were handed to two writers, freed
while in use, evicted while indexed, or shared without copy-on-write, some sequence would read
another's entries, and a prefix hit would serve tokens different from the prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.batch import build_batch_arrays
from kvcache.errors import CacheTooSmall, KVCacheError, SequenceTooLong
from kvcache.manager import KVCacheManager

NUM_BLOCKS = 12
BLOCK_SIZE = 4
MAX_MODEL_LEN = 56  # 14 blocks: longer than the whole cache, so CacheTooSmall can happen
EMPTY = -1

# Prompts share prefixes (chat turns, a system prompt), so prefix hits are common.
SHARED_PREFIXES = [[7, 1, 4, 4, 2, 9, 3, 3, 5, 0, 8, 6, 1, 2, 2, 7, 3, 9, 0, 4], [5] * 20]
prompts = st.builds(
    lambda prefix, length, tail: prefix[:length] + tail,
    st.sampled_from(SHARED_PREFIXES),
    st.integers(0, 20),
    st.lists(st.integers(0, 3), max_size=6),
).filter(bool)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN)
        self.slot_tokens = np.full(NUM_BLOCKS * BLOCK_SIZE, EMPTY)  # token last written to each slot
        self.slot_positions = np.full(NUM_BLOCKS * BLOCK_SIZE, EMPTY)  # and at which position
        self.token_ids: dict[int, list[int]] = {}  # every live sequence's tokens with KV computed
        self.pending_prompt: dict[int, list[int]] = {}  # prompt tokens not computed yet
        self.next_seq_id = 0

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    @rule(prompt=prompts)
    def allocate(self, prompt: list[int]) -> None:
        if not self.kv.can_allocate(prompt):
            return
        seq_id = self.new_seq_id()
        num_cached = self.kv.allocate(seq_id, prompt)
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(prompt)
        self.token_ids[seq_id] = prompt[:num_cached]
        self.pending_prompt[seq_id] = prompt[num_cached:]
        self.assert_reads_own_tokens(seq_id)  # the reused prefix holds exactly these tokens

    @precondition(lambda self: self.token_ids)
    @rule(data=st.data(), chunk=st.integers(1, 7), sampled_token=st.integers(0, 3))
    def step(self, data: st.DataObject, chunk: int, sampled_token: int) -> None:
        """One engine step for one sequence: a prefill chunk, or a decode of a sampled token."""
        seq_id = data.draw(st.sampled_from(sorted(self.token_ids)))
        pending = self.pending_prompt[seq_id]
        new_tokens = pending[:chunk] if pending else [sampled_token]
        num_tokens = len(self.token_ids[seq_id]) + len(new_tokens)
        if num_tokens > MAX_MODEL_LEN:
            with pytest.raises(SequenceTooLong):
                self.kv.can_append(seq_id, len(new_tokens))
            return
        if -(-num_tokens // BLOCK_SIZE) > NUM_BLOCKS:
            with pytest.raises(CacheTooSmall):
                self.kv.can_append(seq_id, len(new_tokens))
            return
        if not self.kv.can_append(seq_id, len(new_tokens)):
            return
        for src, dst in self.kv.append_slots(seq_id, new_tokens):  # copy-on-write, then the KV write
            self.copy_block(src, dst)
        arrays = build_batch_arrays(self.kv, [seq_id], [len(new_tokens)])
        for slot in arrays.slot_mapping.tolist():
            block_id = slot // BLOCK_SIZE
            assert self.kv.pool.ref_count(block_id) == 1, "a written block is owned by its writer alone"
            assert self.kv.pool.block_hash(block_id) is None, "a cached block is never written"
        self.slot_tokens[arrays.slot_mapping] = new_tokens
        self.slot_positions[arrays.slot_mapping] = arrays.positions
        self.token_ids[seq_id] += new_tokens
        del pending[: len(new_tokens) if pending else 0]
        assert arrays.context_lens.tolist() == [len(self.token_ids[seq_id])]

    @precondition(lambda self: any(not pending for pending in self.pending_prompt.values()))
    @rule(data=st.data(), sampled_token=st.integers(0, 3), drafts=st.lists(st.integers(0, 3), min_size=1, max_size=8))
    def speculative_decode(self, data: st.DataObject, sampled_token: int, drafts: list[int]) -> None:
        """A decode with draft tokens, then a rollback of the drafts verification rejected: their KV was
        written, but the sequence goes on as if they had never been, and no prefix hit serves them."""
        seq_id = data.draw(st.sampled_from(sorted(s for s, pending in self.pending_prompt.items() if not pending)))
        new_tokens = [sampled_token, *drafts]
        num_tokens = len(self.token_ids[seq_id]) + len(new_tokens)
        if num_tokens > MAX_MODEL_LEN or -(-num_tokens // BLOCK_SIZE) > NUM_BLOCKS:
            return
        if not self.kv.can_append(seq_id, len(new_tokens)):
            return
        for src, dst in self.kv.append_slots(seq_id, new_tokens):
            self.copy_block(src, dst)
        arrays = build_batch_arrays(self.kv, [seq_id], [len(new_tokens)])
        self.slot_tokens[arrays.slot_mapping] = new_tokens
        self.slot_positions[arrays.slot_mapping] = arrays.positions
        num_accepted = data.draw(st.integers(0, len(drafts)))
        num_blocks_before = self.kv.num_used_blocks
        self.kv.rollback(seq_id, len(drafts) - num_accepted)
        self.token_ids[seq_id] += new_tokens[: 1 + num_accepted]
        num_blocks_needed = -(-len(self.token_ids[seq_id]) // BLOCK_SIZE)
        assert len(self.kv.block_table(seq_id)) == num_blocks_needed  # blocks only rejected drafts used are back
        assert self.kv.num_used_blocks <= num_blocks_before
        with pytest.raises(KVCacheError):
            self.kv.rollback(seq_id, 2 + len(drafts))  # never into positions an earlier step computed

    @precondition(lambda self: self.token_ids)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(sorted(self.token_ids)))
        child_id = self.new_seq_id()
        self.kv.fork(parent_id, child_id)
        self.token_ids[child_id] = list(self.token_ids[parent_id])
        self.pending_prompt[child_id] = list(self.pending_prompt[parent_id])

    @precondition(lambda self: self.token_ids)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.token_ids)))
        token_ids = self.token_ids[seq_id]
        self.kv.free(seq_id)
        del self.token_ids[seq_id], self.pending_prompt[seq_id]
        # Whatever of its tokens the prefix index now serves holds those tokens.
        hits, _ = self.kv.pool.match_prefix(token_ids, len(token_ids) // BLOCK_SIZE)
        slots = (np.asarray(hits, dtype=np.int64)[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).ravel()
        assert self.slot_tokens[slots].tolist() == token_ids[: len(slots)]

    def copy_block(self, src: int, dst: int) -> None:
        src_slots = slice(src * BLOCK_SIZE, (src + 1) * BLOCK_SIZE)
        dst_slots = slice(dst * BLOCK_SIZE, (dst + 1) * BLOCK_SIZE)
        self.slot_tokens[dst_slots] = self.slot_tokens[src_slots]
        self.slot_positions[dst_slots] = self.slot_positions[src_slots]

    def assert_reads_own_tokens(self, seq_id: int) -> None:
        token_ids = self.token_ids[seq_id]
        positions = np.arange(len(token_ids))
        slots = self.kv.block_table(seq_id)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        assert self.slot_tokens[slots].tolist() == token_ids
        assert self.slot_positions[slots].tolist() == positions.tolist()

    @invariant()
    def every_sequence_reads_its_own_context(self) -> None:
        for seq_id in self.token_ids:
            self.assert_reads_own_tokens(seq_id)

    @invariant()
    def reference_counts_match_the_block_tables(self) -> None:
        expected = np.zeros(NUM_BLOCKS, dtype=int)
        for seq_id in self.token_ids:
            np.add.at(expected, self.kv.block_table(seq_id), 1)
        assert [self.kv.pool.ref_count(b) for b in range(NUM_BLOCKS)] == expected.tolist()
        num_hashed_unused = sum(
            1 for b in range(NUM_BLOCKS) if expected[b] == 0 and self.kv.pool.block_hash(b) is not None
        )
        assert self.kv.num_used_blocks == np.count_nonzero(expected)
        assert self.kv.num_cached_blocks == num_hashed_unused
        assert self.kv.num_used_blocks + self.kv.num_free_blocks + self.kv.num_cached_blocks == NUM_BLOCKS

    def teardown(self) -> None:
        for seq_id in list(self.token_ids):
            self.kv.free(seq_id)
        assert self.kv.num_used_blocks == 0
        assert all(self.kv.pool.ref_count(b) == 0 for b in range(NUM_BLOCKS))
        assert self.kv.num_free_blocks + self.kv.num_cached_blocks == NUM_BLOCKS


def test_rejected_drafts_never_enter_the_prefix_index():
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN)
    kv.allocate(1, [10, 11, 12])
    kv.append_slots(1, [10, 11, 12])
    kv.append_slots(1, [13, 20, 21, 22, 23, 24])  # the sampled token and five drafts
    assert len(kv.block_table(1)) == 3
    kv.rollback(1, 4)  # one draft accepted
    assert len(kv.block_table(1)) == 2 and kv.num_tokens(1) == 5
    for token in (30, 31, 32):  # the next decodes take the rejected drafts' slots
        kv.append_slots(1, [token])
    kv.free(1)
    assert len(kv.pool.match_prefix([10, 11, 12, 13, 20, 30, 31, 32], 2)[0]) == 2
    assert len(kv.pool.match_prefix([10, 11, 12, 13, 20, 21, 22, 23], 2)[0]) == 1


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much],
)
test_block_manager_invariants = BlockManagerMachine.TestCase
