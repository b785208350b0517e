"""The prefix cache beyond the KV pool: host memory, then disk, both keyed by the pool's block hashes.

    pool (KV arrays) --evicted--> host memory (HostTier) --evicted--> disk (DiskTier)
         ^                              |                                |
         +------- a prompt's prefix found in either is copied back ------+

A full block the pool evicts from its LRU is copied into host memory instead of being lost; one the
host tier evicts is written to disk. With a disk tier, every block the pool publishes is also
written through (copied here, written by the disk tier's thread), so a crash loses only what was
still queued, and a graceful shutdown writes whatever is still missing (`flush`). A prefix lookup
that runs past the pool's blocks goes on here: each block found is copied into a freshly allocated
pool block instead of being computed (`KVCacheManager.allocate`: `fetch`, then `copy_in`).

Block hashes chain from a root that binds the model file, the KV dtype, the block size, the kernel
mode and the code that computes KV (`namespace`), so no tier can ever hand one configuration the KV
of another. Every method runs on the engine thread (the disk tier's writer aside).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcache.block_pool import BlockHash
from kvcache.disk_tier import FORMAT_VERSION, BlockFileIdentity, DiskTier
from kvcache.host_tier import HostTier
from kvcache.storage import KVCacheStorage

log = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20
# the code whose output the KV is: a change to any of it makes cached blocks another namespace's
_KV_CODE_DIRS = ("decoding/kernels", "decoding/model", "kvcache")


def file_fingerprint(path: Path) -> bytes:
    """16 bytes naming a model's weights: for a file its size and its first and last MiB (a copy of the
    file has the same; reading all of a 5 GB file at every start would cost seconds); for a directory
    the same over its files."""
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else ''}\0{size}\0".encode())
        with file.open("rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.digest()


def kv_code_hash() -> bytes:
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.blake2b(digest_size=16)
    for directory in _KV_CODE_DIRS:
        for source in sorted((root / directory).glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.digest()


def namespace(model_fingerprint: bytes, dtype: str, block_size: int, kernels: str) -> BlockHash:
    """The root of every block hash chain: equal only where cached KV is interchangeable."""
    identity = f"treadle-kv\0{FORMAT_VERSION}\0{dtype}\0{block_size}\0{kernels}\0".encode()
    return hashlib.blake2b(identity + model_fingerprint + kv_code_hash(), digest_size=16).digest()


@dataclass(slots=True)
class TierCounters:
    """One tier's cumulative counters (the pool's, the host tier's or the disk tier's)."""

    hits: int = 0  # blocks a prompt found here
    misses: int = 0  # lookups that reached this tier and found nothing
    evictions: int = 0  # blocks pushed out for room
    bytes_read: int = 0  # copied out of this tier into the pool
    bytes_written: int = 0  # copied into this tier
    copy_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class TierSettings:
    ram_bytes: int
    directory: Path | None = None
    disk_bytes: int = 0
    flush_seconds: float = 10.0  # at shutdown, writing what is missing on disk


class PrefixTiers:
    """The host-memory and disk tiers of one KV pool."""

    def __init__(self, storage: KVCacheStorage, settings: TierSettings, root_hash: BlockHash,
                 model_fingerprint: bytes, kernels: str) -> None:
        self.storage = storage
        self.settings = settings
        spec = storage.spec
        self.block_shape = (2, spec.n_layers, spec.n_kv_heads * spec.row_width * spec.block_size)
        self.block_bytes = int(np.prod(self.block_shape)) * np.dtype(spec.storage_type).itemsize
        self.ram = TierCounters()
        self.disk_counters = TierCounters()
        self.disk: DiskTier | None = None
        if settings.directory is not None and settings.disk_bytes >= self.block_bytes:
            identity = BlockFileIdentity(root_hash, model_fingerprint, spec.dtype, kernels, spec.block_size,
                                         self.block_shape, spec.storage_type)
            self.disk = DiskTier(settings.directory, settings.disk_bytes, identity)
        self.host = HostTier(settings.ram_bytes, on_evict=self._to_disk)

    @property
    def is_enabled(self) -> bool:
        return self.settings.ram_bytes >= self.block_bytes or self.disk is not None

    def describe(self) -> str:
        ram = f"{self.settings.ram_bytes / 2**20:.0f} MiB in host memory" if self.settings.ram_bytes else "none in RAM"
        if self.disk is None:
            return f"prefix cache beyond the KV pool: {ram}, none on disk"
        return (f"prefix cache beyond the KV pool: {ram}, {self.settings.disk_bytes / 2**20:.0f} MiB on disk in "
                f"{self.disk.directory} ({self.disk.num_blocks} blocks of {self.block_bytes / 2**20:.2f} MiB found)")

    # ---- the pool's hooks --------------------------------------------------------------------------

    def spill(self, block_hash: BlockHash, block_id: int) -> None:
        """The pool evicts this block: keep a copy (before anything overwrites it)."""
        has_ram = self.settings.ram_bytes >= self.block_bytes
        if not has_ram and (self.disk is None or self.disk.contains(block_hash)):
            return
        started = time.perf_counter()
        block = self._copy_out(block_id)
        if has_ram:
            self.ram.copy_seconds += time.perf_counter() - started
            self.ram.bytes_written += self.block_bytes
            self.host.put(block_hash, block)
        else:
            self.disk_counters.copy_seconds += time.perf_counter() - started
            self.disk.write(block_hash, block)  # type: ignore[union-attr]

    def published(self, block_hash: BlockHash, block_id: int, bounded: bool = True) -> None:
        """The pool indexed a computed block: write it through to disk, in the background."""
        if self.disk is None or self.disk.contains(block_hash):
            return
        started = time.perf_counter()
        block = self._copy_out(block_id)
        self.disk_counters.copy_seconds += time.perf_counter() - started
        self.disk.write(block_hash, block, bounded)

    def fetch(self, block_hash: BlockHash) -> np.ndarray | None:
        """Take a block from host memory, or read it from disk; None if neither has it (any more).
        Taken before the pool allocates the blocks it goes into, so that the spills those
        allocations cause cannot push it out of host memory first."""
        started = time.perf_counter()
        block = self.host.take(block_hash)
        counters = self.ram
        if block is None:
            self.ram.misses += 1
            if self.disk is not None:
                counters = self.disk_counters
                block = self.disk.read(block_hash)
                if block is None:
                    self.disk_counters.misses += 1
        if block is None:
            return None
        counters.hits += 1
        counters.bytes_read += self.block_bytes
        counters.copy_seconds += time.perf_counter() - started
        return block

    def copy_in(self, block_id: int, block: np.ndarray) -> None:
        """Write a fetched block into pool block `block_id`."""
        storage = self.storage
        started = time.perf_counter()
        storage.key_cache[:, :, block_id] = block[0].reshape(storage.key_cache[:, :, block_id].shape)
        storage.value_cache[:, :, block_id] = block[1].reshape(storage.value_cache[:, :, block_id].shape)
        self.ram.copy_seconds += time.perf_counter() - started

    # ---- operations ----------------------------------------------------------------------------------

    def flush(self, pool_blocks: Iterable[tuple[BlockHash, int]]) -> bool:
        """Write every block held in the pool or in host memory that the disk lacks, within the
        flush time bound; True if all reached the disk."""
        if self.disk is None:
            return True
        for block_hash, block_id in pool_blocks:
            self.published(block_hash, block_id, bounded=False)
        for block_hash, block in self.host.items():
            self.disk.write(block_hash, block, bounded=False)
        return self.disk.flush(self.settings.flush_seconds)

    def clear(self) -> dict[str, int]:
        """Empty both tiers; returns the blocks each dropped."""
        cleared = {"ram": len(self.host)}
        self.host.clear()
        if self.disk is not None:
            cleared["disk"] = self.disk.clear()
        return cleared

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close(self.settings.flush_seconds)

    # ---- copies -----------------------------------------------------------------------------------

    def _copy_out(self, block_id: int) -> np.ndarray:
        storage = self.storage
        block = np.empty(self.block_shape, dtype=storage.spec.storage_type)
        n_layers = self.block_shape[1]
        block[0] = storage.key_cache[:, :, block_id].reshape(n_layers, -1)
        block[1] = storage.value_cache[:, :, block_id].reshape(n_layers, -1)
        return block

    def _to_disk(self, block_hash: BlockHash, block: np.ndarray) -> None:
        """The host tier evicts a block: the disk keeps it, where there is one."""
        self.ram.evictions += 1
        if self.disk is not None:
            self.disk.write(block_hash, block)

    def counters(self, tier: str) -> TierCounters:
        """A tier's counters ("ram" or "disk"), the disk's with what its writer thread counted."""
        if tier == "ram":
            return self.ram
        counters = self.disk_counters
        if self.disk is None:
            return counters
        stats = self.disk.stats
        return TierCounters(counters.hits, counters.misses, stats.num_evictions, counters.bytes_read,
                            stats.bytes_written, counters.copy_seconds + stats.write_seconds)
