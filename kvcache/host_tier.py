"""The prefix cache's host-memory tier: copies of full KV blocks evicted from the pool, by block hash.

A bounded least-recently-used map from a block's chain hash to its K and V on every layer (one
array of shape (2, n_layers, elements per layer)). It is a victim cache: a block enters when the
pool evicts it and leaves when a prompt takes it back into the pool (it then lives there again),
when `clear` empties it, or as the least recently used when room is needed, handed to `on_evict`
(the disk tier, where there is one). Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np

from kvcache.block_pool import BlockHash


class HostTier:
    def __init__(self, max_bytes: int, on_evict: Callable[[BlockHash, np.ndarray], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.num_bytes = 0
        self._blocks: OrderedDict[BlockHash, np.ndarray] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: BlockHash, block: np.ndarray) -> None:
        """Keep a block (it is not copied: the caller hands it over), making room by evicting the least
        recently used; a block larger than the whole tier goes straight to `on_evict`."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        if block.nbytes > self.max_bytes:
            self._hand_on(block_hash, block)
            return
        while self.num_bytes + block.nbytes > self.max_bytes:
            victim_hash, victim = self._blocks.popitem(last=False)
            self.num_bytes -= victim.nbytes
            self._hand_on(victim_hash, victim)
        self._blocks[block_hash] = block
        self.num_bytes += block.nbytes

    def take(self, block_hash: BlockHash) -> np.ndarray | None:
        """Remove and return a block (a prompt takes it back into the pool), or None."""
        block = self._blocks.pop(block_hash, None)
        if block is not None:
            self.num_bytes -= block.nbytes
        return block

    def items(self) -> Iterator[tuple[BlockHash, np.ndarray]]:
        return iter(list(self._blocks.items()))

    def clear(self) -> None:
        self._blocks.clear()
        self.num_bytes = 0

    def _hand_on(self, block_hash: BlockHash, block: np.ndarray) -> None:
        if self.on_evict is not None:
            self.on_evict(block_hash, block)
