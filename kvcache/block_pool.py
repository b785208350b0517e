"""Fixed-size KV blocks: reference counts, a free list and the prefix-cache index.

Every block is in exactly one of three states, so `used + cached + free == num_blocks` always:

- *used*: `ref_count > 0`, held by one or more sequences (several after a prefix hit or a fork);
- *cached*: `ref_count == 0` but it carries a hash, so a later prompt with the same prefix can take
  it back without recomputing; kept in least-recently-released order;
- *free*: `ref_count == 0` and no hash.

A new block comes from the free list first; only when that is empty is the least recently released
cached block evicted (its hash dropped from the index). Nothing here touches the KV arrays: the pool
hands out block ids, and `storage.KVCacheStorage` owns what they point at; `on_evict` and `on_publish`
tell whoever keeps copies of blocks beyond the pool (`prefix_tiers.PrefixTiers`).

Every operation is a list, dict or OrderedDict operation: O(1), cheap enough to run per step.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvcache.errors import KVCacheError, OutOfBlocks

# A block's identity in the prefix cache: a digest of its tokens and, through the parent's digest, of
# every token before it.
BlockHash = bytes

# The parent hash of a sequence's first block, unless the pool is given a namespace's root.
ROOT_HASH: BlockHash = b""


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chain hash of a full block: BLAKE2b-128 of (parent digest || token ids as int32).

    Chaining makes two blocks equal only if their whole prefixes are equal (vLLM's scheme). A
    collision would silently serve one prompt the KV of another, so the hash is cryptographic and
    128 bits wide (vLLM moved from Python's `hash` to sha256 for the same reason): even 2**32
    distinct blocks collide with probability about 2**-64. The encoding is fixed-width, so no two
    different token lists produce the same bytes. Digests outlive the process only in the prefix
    tiers, whose chains start from a root that names the model and the KV's form.
    """
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("i", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    """Hands out block ids, counts their references and indexes full blocks by hash."""

    def __init__(self, num_blocks: int, block_size: int, root_hash: BlockHash = ROOT_HASH) -> None:
        if num_blocks < 1:
            raise KVCacheError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root_hash = root_hash
        # Called with (hash, block id) while the block's KV is still intact: before an evicted block is
        # handed out again, and when a written block is first indexed.
        self.on_evict: Callable[[BlockHash, int], None] | None = None
        self.on_publish: Callable[[BlockHash, int], None] | None = None
        self.num_evictions = 0
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Popped from the end, so block 0 goes out first: a lightly loaded engine touches little memory.
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks, least recently released first.
        self._cached_block_ids: OrderedDict[int, None] = OrderedDict()
        self._block_id_by_hash: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference and no hash."""
        return len(self._free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with no reference that a matching prefix can still reuse (evictable)."""
        return len(self._cached_block_ids)

    @property
    def num_available_blocks(self) -> int:
        """Blocks that `allocate` can hand out: free ones, then cached ones by eviction."""
        return len(self._free_block_ids) + len(self._cached_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_available_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this full block's KV, used or cached, if any."""
        return self._block_id_by_hash.get(block_hash)

    def hashed_blocks(self) -> list[tuple[BlockHash, int]]:
        """(hash, block id) of every indexed block, used or cached."""
        return list(self._block_id_by_hash.items())

    def match_prefix(self, token_ids: Sequence[int], max_num_blocks: int) -> tuple[list[int], BlockHash]:
        """The indexed blocks of the longest run (up to max_num_blocks) of token_ids' leading full
        blocks, and the hash of the last one (`root_hash` if none). Takes no reference."""
        block_ids: list[int] = []
        block_hash = self.root_hash
        tokens = array("i", token_ids)  # sliced per block without building Python lists
        for start in range(0, max_num_blocks * self.block_size, self.block_size):
            next_hash = hash_block(block_hash, tokens[start : start + self.block_size])
            block_id = self._block_id_by_hash.get(next_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
            block_hash = next_hash
        return block_ids, block_hash

    def publish_chain(
        self, block_ids: Sequence[int], parent_hash: BlockHash, token_ids: Sequence[int]
    ) -> BlockHash:
        """Publish consecutive full blocks holding token_ids after the block hashed parent_hash;
        returns the last block's hash, the parent of whatever follows."""
        tokens = array("i", token_ids)
        for index, block_id in enumerate(block_ids):
            start = index * self.block_size
            parent_hash = hash_block(parent_hash, tokens[start : start + self.block_size])
            self.publish(block_id, parent_hash)
        return parent_hash

    def allocate(self) -> int:
        """A fresh block with one reference; its contents are whatever was there before."""
        if self._free_block_ids:
            block_id = self._free_block_ids.pop()
        elif self._cached_block_ids:
            block_id, _ = self._cached_block_ids.popitem(last=False)
            self._evict(block_id)
        else:
            raise OutOfBlocks("no free KV block left")
        self._ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """Take another reference to a block that is used, or cached (a prefix hit revives it)."""
        if self._ref_counts[block_id] == 0:
            if block_id not in self._cached_block_ids:
                raise KVCacheError(f"block {block_id} is free: there is nothing in it to share")
            del self._cached_block_ids[block_id]
        self._ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached (if hashed) or free."""
        ref_count = self._ref_counts[block_id]
        if ref_count == 0:
            raise KVCacheError(f"block {block_id} released more often than it was taken")
        self._ref_counts[block_id] = ref_count - 1
        if ref_count == 1:
            if self._block_hashes[block_id] is None:
                self._free_block_ids.append(block_id)
            else:
                self._cached_block_ids[block_id] = None  # most recently released: evicted last

    def publish(self, block_id: int, block_hash: BlockHash) -> None:
        """Index a used, full block whose KV has been written, so equal prefixes can reuse it.

        When another block already holds the same content (two sequences computed the same prefix
        at once), the first stays indexed and this one simply returns to the free list when released.
        """
        if self._ref_counts[block_id] == 0:
            raise KVCacheError(f"block {block_id} is not in use: its contents are not known")
        if block_hash in self._block_id_by_hash or self._block_hashes[block_id] is not None:
            return
        self._block_hashes[block_id] = block_hash
        self._block_id_by_hash[block_hash] = block_id
        if self.on_publish is not None:
            self.on_publish(block_hash, block_id)

    def forget_prefixes(self) -> int:
        """Drop every hash from the index (cached blocks become free; used ones stay with their
        sequences, unshared from now on); returns how many blocks were indexed."""
        num_indexed = len(self._block_id_by_hash)
        for block_id in self._cached_block_ids:
            self._free_block_ids.append(block_id)
        self._cached_block_ids.clear()
        self._block_id_by_hash.clear()
        self._block_hashes = [None] * self.num_blocks
        return num_indexed

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        assert block_hash is not None, "only hashed blocks are ever cached"
        if self.on_evict is not None:
            self.on_evict(block_hash, block_id)
        del self._block_id_by_hash[block_hash]
        self._block_hashes[block_id] = None
        self.num_evictions += 1
