"""Per-sequence block tables over a `BlockPool`: what the scheduler calls, and what the kernels read.

The life of a sequence (one engine step per line; `kv` is a `KVCacheManager`):

    if kv.can_allocate(prompt_ids):                      # admission; raises if it can never fit
        num_computed = kv.allocate(seq_id, prompt_ids)   # prefix hits are already computed
    copies = kv.append_slots(seq_id, prompt_ids[num_computed:num_computed + chunk])   # prefill chunk
    ...                                                  # more chunks until the prompt is done
    if kv.can_append(seq_id):                            # else preempt someone (kv.free) and retry
        copies = kv.append_slots(seq_id, [last_sampled_token_id])                     # decode
    copies = kv.append_slots(seq_id, [last_token, *draft_tokens])                     # speculative decode
    kv.rollback(seq_id, num_rejected)                    # after its step: the drafts verification refused
    kv.free(seq_id)                                      # finished, aborted or preempted
    kv.free(seq_id, latest_step_ran=False)               # its step failed: publish none of its KV

`allocate` reserves blocks for the whole prompt, so a half-prefilled sequence never stalls for want
of memory and two long prompts cannot each hold half the cache. `append_slots` is told the tokens
whose KV the coming step computes. The blocks they fill are published in the prefix index (prompt
and generated tokens alike) when the sequence's next `append_slots` or its `free` shows that step
has run, so a prefix lookup never finds a block whose KV is still unwritten, even if the runner
splits a step into several forward passes. After preemption, `allocate(seq_id, all_token_ids)`
finds the sequence's own blocks again unless they were evicted.

With prefix tiers (`prefix_tiers.PrefixTiers`), evicted blocks are kept in host memory or on disk, and
`allocate` goes on looking past the pool's blocks there: each block found is copied into a freshly
allocated block, published at once (its KV is whole), and counts as computed.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvcache.block_pool import ROOT_HASH, BlockHash, BlockPool, hash_block
from kvcache.errors import CacheTooSmall, KVCacheError, OutOfBlocks, SequenceTooLong

if TYPE_CHECKING:
    from kvcache.prefix_tiers import PrefixTiers

log = logging.getLogger(__name__)

# (source block id, destination block id): a copy the runner performs, on every layer's K and V,
# before this step's KV writes (`KVCacheStorage.copy_blocks`).
BlockCopy = tuple[int, int]


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters over every `allocate` (re-admissions after preemption too)."""

    num_requests: int = 0
    num_query_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # of which found already computed (in the pool or a tier)
    num_pool_hit_blocks: int = 0  # blocks found in the pool
    num_tier_hit_blocks: int = 0  # blocks copied back from host memory or disk

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(slots=True)
class _SequenceBlocks:
    block_table: np.ndarray  # (max_blocks_per_seq,) int32: physical block of each logical block
    num_blocks: int  # logical blocks held; block_table[num_blocks:] is stale
    num_tokens: int  # positions with a slot: computed, or being computed by the latest step
    num_latest_tokens: int  # of those, the ones the latest append_slots gave: unwritten until its step runs
    num_published_blocks: int  # leading full blocks already offered to the prefix index
    last_published_hash: BlockHash  # hash of block num_published_blocks - 1 (ROOT_HASH if none)
    unpublished_token_ids: list[int]  # tokens at positions [num_published_blocks * block_size, num_tokens)


class KVCacheManager:
    """Block tables for every live sequence, with automatic prefix caching over full blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int = 8192,
        enable_prefix_caching: bool = True,
        root_hash: BlockHash = ROOT_HASH,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, root_hash)
        self.tiers: PrefixTiers | None = None
        self.stats = PrefixCacheStats()
        self._seqs: dict[int, _SequenceBlocks] = {}

    def attach_tiers(self, tiers: PrefixTiers) -> None:
        """Keep evicted blocks in `tiers`, write published ones through, and look there past the pool."""
        if not self.enable_prefix_caching:
            raise KVCacheError("prefix tiers need prefix caching")
        self.tiers = tiers
        self.pool.on_evict = tiers.spill
        self.pool.on_publish = tiers.published

    def flush_tiers(self) -> bool:
        """Write what the disk tier lacks (a graceful shutdown); True if all of it reached the disk."""
        return self.tiers.flush(self.pool.hashed_blocks()) if self.tiers is not None else True

    def close_tiers(self) -> None:
        """At a graceful shutdown: write what the disk tier lacks, within its time bound, and close it.
        A failing disk costs the cache, never the shutdown."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None:
            return
        started = time.monotonic()
        try:
            complete = self.flush_tiers()
            tiers.close()
        except Exception:  # noqa: BLE001 - the disk is a cache: a shutdown still ends
            log.exception("could not write the prefix cache to disk")
            return
        log.info("prefix cache on disk: %d blocks in %s (%s in %.1f s)", tiers.disk.num_blocks, tiers.disk.directory,
                 "all written" if complete else "the flush ran out of time", time.monotonic() - started)

    def clear_prefix_cache(self) -> dict[str, int]:
        """Forget every cached prefix, in the pool and in the tiers; returns the blocks each dropped.
        Running sequences keep their blocks (no longer shared with later prompts)."""
        cleared = {"pool": self.pool.forget_prefixes()}
        if self.tiers is not None:
            cleared.update(self.tiers.clear())
        return cleared

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks without a hash (see also `num_cached_blocks`)."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding a reusable prefix; evicted LRU when room is needed."""
        return self.pool.num_cached_blocks

    def block_table(self, seq_id: int) -> np.ndarray:
        """(num_blocks_held,) int32, read-only: the physical block of each logical block."""
        seq = self._seqs[seq_id]
        view = seq.block_table[: seq.num_blocks]
        view.flags.writeable = False
        return view

    def num_tokens(self, seq_id: int) -> int:
        """Positions of this sequence with a KV slot (its context length after the latest step)."""
        return self._seqs[seq_id].num_tokens

    def can_allocate(self, prompt_ids: Sequence[int], use_prefix_cache: bool = True) -> bool:
        """Whether `allocate` would succeed now; raises if it never could (see `check_fits`)."""
        self.check_fits(len(prompt_ids))
        hit_block_ids, _ = self._match_prefix(prompt_ids, use_prefix_cache)
        return self._num_blocks_to_allocate(len(prompt_ids), hit_block_ids) <= self.pool.num_available_blocks

    def allocate(self, seq_id: int, prompt_ids: Sequence[int], use_prefix_cache: bool = True) -> int:
        """Take the cached prefix and reserve blocks for the rest of the prompt.

        Returns how many prompt tokens are already computed: a multiple of block_size, and never the
        whole prompt, because the last prompt token must run to produce logits. The remaining tokens
        go to `append_slots`, in one call or in chunks. `use_prefix_cache=False` computes every token
        (a request that wants the logits of its whole prompt); its blocks are still published.
        """
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already holds blocks")
        self.check_fits(len(prompt_ids))
        hit_block_ids, last_hit_hash = self._match_prefix(prompt_ids, use_prefix_cache)
        if self._num_blocks_to_allocate(len(prompt_ids), hit_block_ids) > self.pool.num_available_blocks:
            raise OutOfBlocks(f"sequence {seq_id} does not fit now: check can_allocate first")
        for block_id in hit_block_ids:  # before allocating, so that no hit is evicted to make room
            self.pool.share(block_id)
        # Past the pool's hits, what a tier kept, in order until one lacks a block: taken before
        # allocating too, so that the spills allocation causes cannot push it out first.
        found: list[tuple[BlockHash, np.ndarray]] = []
        max_hit_blocks = self._max_hit_blocks(prompt_ids, use_prefix_cache)
        if self.tiers is not None and len(hit_block_ids) < max_hit_blocks:
            tokens = array("i", prompt_ids)
            for logical_block in range(len(hit_block_ids), max_hit_blocks):
                start = logical_block * self.block_size
                block_hash = hash_block(last_hit_hash, tokens[start : start + self.block_size])
                block = self.tiers.fetch(block_hash)
                if block is None:
                    break
                found.append((block_hash, block))
                last_hit_hash = block_hash
        num_blocks = self._num_blocks_for(len(prompt_ids))
        block_table = np.zeros(self.max_blocks_per_seq, dtype=np.int32)
        block_table[: len(hit_block_ids)] = hit_block_ids
        for logical_block in range(len(hit_block_ids), num_blocks):
            block_table[logical_block] = self.pool.allocate()
        for offset, (block_hash, block) in enumerate(found):
            block_id = int(block_table[len(hit_block_ids) + offset])
            self.tiers.copy_in(block_id, block)  # type: ignore[union-attr]
            self.pool.publish(block_id, block_hash)  # its KV is whole: other prompts may share it now
        num_found = len(hit_block_ids) + len(found)
        num_hit_tokens = num_found * self.block_size
        self._seqs[seq_id] = _SequenceBlocks(
            block_table, num_blocks, num_hit_tokens, 0, num_found, last_hit_hash, []
        )
        self.stats.num_requests += 1
        self.stats.num_query_tokens += len(prompt_ids)
        self.stats.num_hit_tokens += num_hit_tokens
        self.stats.num_pool_hit_blocks += len(hit_block_ids)
        self.stats.num_tier_hit_blocks += num_found - len(hit_block_ids)
        return num_hit_tokens

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Whether `append_slots` for this many tokens would succeed now; raises if it never could."""
        seq = self._seqs[seq_id]
        self.check_fits(seq.num_tokens + num_new_tokens)
        return self._num_blocks_to_append(seq, num_new_tokens) <= self.pool.num_available_blocks

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[BlockCopy]:
        """Give slots to the tokens whose KV the coming step computes (a prefill chunk, or the last
        sampled token when decoding), after the tokens of every previous call.

        Returns the block copies to perform before this step's KV writes: a block still shared with
        a fork is never written; the writer gets a private copy instead (copy-on-write).
        """
        seq = self._seqs[seq_id]
        num_new_tokens = len(token_ids)
        self.check_fits(seq.num_tokens + num_new_tokens)
        if self._num_blocks_to_append(seq, num_new_tokens) > self.pool.num_available_blocks:
            raise OutOfBlocks(f"sequence {seq_id} cannot grow now: check can_append first")
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq)  # this call proves the previous step ran
            seq.unpublished_token_ids.extend(token_ids)
        copies = self._unshare_blocks(seq, seq.num_tokens, seq.num_tokens + num_new_tokens)
        for logical_block in range(seq.num_blocks, self._num_blocks_for(seq.num_tokens + num_new_tokens)):
            seq.block_table[logical_block] = self.pool.allocate()
            seq.num_blocks += 1
        seq.num_tokens += num_new_tokens
        seq.num_latest_tokens = num_new_tokens
        return copies

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Drop the sequence's last `num_tokens` positions, all given by its latest `append_slots`
        (speculative tokens its step computed and verification rejected), after that step ran. The
        next tokens take their slots; blocks only they filled go back to the pool, and none of them
        enters the prefix index."""
        seq = self._seqs[seq_id]
        if not 0 <= num_tokens <= seq.num_latest_tokens:
            raise KVCacheError(f"can roll back 0..{seq.num_latest_tokens} of sequence {seq_id}'s latest "
                               f"positions, not {num_tokens}")
        if num_tokens == 0:
            return
        seq.num_tokens -= num_tokens
        seq.num_latest_tokens -= num_tokens
        if self.enable_prefix_caching:
            del seq.unpublished_token_ids[len(seq.unpublished_token_ids) - num_tokens :]
        num_blocks = self._num_blocks_for(seq.num_tokens)
        for logical_block in range(seq.num_blocks - 1, num_blocks - 1, -1):
            self.pool.release(int(seq.block_table[logical_block]))
        seq.num_blocks = num_blocks

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make `child_id` share every block of `parent_id` (e.g. for n > 1 samples of one prompt)."""
        if child_id in self._seqs:
            raise KVCacheError(f"sequence {child_id} already holds blocks")
        parent = self._seqs[parent_id]
        for block_id in parent.block_table[: parent.num_blocks].tolist():
            self.pool.share(block_id)
        self._seqs[child_id] = _SequenceBlocks(
            parent.block_table.copy(),
            parent.num_blocks,
            parent.num_tokens,
            parent.num_latest_tokens,
            parent.num_published_blocks,
            parent.last_published_hash,
            list(parent.unpublished_token_ids),
        )

    def free(self, seq_id: int, latest_step_ran: bool = True) -> None:
        """Release every block of the sequence; full blocks stay cached for later prefixes until evicted.

        Publishes the blocks its latest `append_slots` filled, as computed, unless `latest_step_ran`
        is False: a step that failed (or was never run) left them unwritten, and a prefix lookup
        must never find them. Never call it with True between an `append_slots` and that step's
        forward pass.
        """
        seq = self._seqs.pop(seq_id)
        if self.enable_prefix_caching:
            if not latest_step_ran:
                seq.num_tokens -= seq.num_latest_tokens
            self._publish_full_blocks(seq)
        # Tail first, so least-recently-used eviction takes a prefix's tail before the blocks it extends.
        for block_id in reversed(seq.block_table[: seq.num_blocks].tolist()):
            self.pool.release(block_id)

    def free_all(self, latest_step_ran: bool = True) -> None:
        """Free every sequence (the engine starting afresh after an error it cannot place)."""
        for seq_id in list(self._seqs):
            self.free(seq_id, latest_step_ran)

    def check_fits(self, num_tokens: int) -> None:
        """Raise if a sequence of this many tokens could never be held, however long it waited."""
        if num_tokens < 1:
            raise KVCacheError("a sequence needs at least one token")
        if num_tokens > self.max_model_len:
            raise SequenceTooLong(f"{num_tokens} tokens exceed the model's context of {self.max_model_len}")
        if self._num_blocks_for(num_tokens) > self.pool.num_blocks:
            raise CacheTooSmall(
                f"{num_tokens} tokens need {self._num_blocks_for(num_tokens)} KV blocks;"
                f" the whole cache has {self.pool.num_blocks}"
            )

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _max_hit_blocks(self, prompt_ids: Sequence[int], use_prefix_cache: bool) -> int:
        """Only blocks that end before the last prompt token can be found: that token always runs,
        to give logits."""
        enabled = self.enable_prefix_caching and use_prefix_cache
        return (len(prompt_ids) - 1) // self.block_size if enabled else 0

    def _match_prefix(self, prompt_ids: Sequence[int], use_prefix_cache: bool) -> tuple[list[int], BlockHash]:
        """Cached blocks of the prompt's longest indexed prefix and the last one's hash."""
        return self.pool.match_prefix(prompt_ids, self._max_hit_blocks(prompt_ids, use_prefix_cache))

    def _num_blocks_to_allocate(self, num_prompt_tokens: int, hit_block_ids: list[int]) -> int:
        # A hit on a cached (unreferenced) block takes it out of the available pool too.
        num_revived = sum(1 for block_id in hit_block_ids if self.pool.ref_count(block_id) == 0)
        return self._num_blocks_for(num_prompt_tokens) - len(hit_block_ids) + num_revived

    def _num_blocks_to_append(self, seq: _SequenceBlocks, num_new_tokens: int) -> int:
        num_new_blocks = max(0, self._num_blocks_for(seq.num_tokens + num_new_tokens) - seq.num_blocks)
        return num_new_blocks + len(
            self._shared_blocks_in(seq, seq.num_tokens, seq.num_tokens + num_new_tokens)
        )

    def _shared_blocks_in(self, seq: _SequenceBlocks, start: int, end: int) -> list[int]:
        """Logical blocks already held and shared with another sequence among positions [start, end)."""
        last_held = min(seq.num_blocks, self._num_blocks_for(end))
        return [
            logical_block
            for logical_block in range(start // self.block_size, last_held)
            if self.pool.ref_count(int(seq.block_table[logical_block])) > 1
        ]

    def _unshare_blocks(self, seq: _SequenceBlocks, start: int, end: int) -> list[BlockCopy]:
        """Copy-on-write: swap each shared block about to be written for a private copy."""
        copies: list[BlockCopy] = []
        for logical_block in self._shared_blocks_in(seq, start, end):
            shared_id = int(seq.block_table[logical_block])
            private_id = self.pool.allocate()
            self.pool.release(shared_id)  # still held by the other sharers
            seq.block_table[logical_block] = private_id
            copies.append((shared_id, private_id))
        return copies

    def _publish_full_blocks(self, seq: _SequenceBlocks) -> None:
        """Index every block filled by the tokens appended so far (their step has run)."""
        num_new_full = seq.num_tokens // self.block_size - seq.num_published_blocks
        if num_new_full == 0:
            return
        block_ids = seq.block_table[
            seq.num_published_blocks : seq.num_published_blocks + num_new_full
        ].tolist()
        seq.last_published_hash = self.pool.publish_chain(
            block_ids, seq.last_published_hash, seq.unpublished_token_ids[: num_new_full * self.block_size]
        )
        del seq.unpublished_token_ids[: num_new_full * self.block_size]
        seq.num_published_blocks += num_new_full
