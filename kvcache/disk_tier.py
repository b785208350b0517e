"""The prefix cache's disk tier: one file per full KV block, kept across restarts, shared by servers.

A file is named after its block's chain hash (`<hex>.kvb`) and holds a fixed header then the block's
K and V on every layer (`BlockFileHeader`): the format version, the namespace the hash was made in
(it binds the model file, the KV dtype, the block size, the kernel mode and the code that computes
KV), those fields again in readable form, the token count, the payload's size and its CRC-32. A file
whose header, size or checksum does not match what this server would write — another model, dtype
or block size, an older format, a truncated or corrupt write, something foreign — is never loaded:
it is removed, and logged once per kind.

Writes go through a background thread (the engine never waits on the disk to spill or write
through), to a temporary name then `os.replace`, so a reader (this server or another pointed at
the same directory) sees a whole file or none. Readers tolerate files vanishing under them (another
server evicted them). The tier is bounded in bytes and evicts least recently used files; a hit
touches the file's mtime, so the order survives restarts and is shared between servers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcache.block_pool import BlockHash

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: an int8 cache's tiles hold their values as vpdpbusd operands (kvcache.storage)
MAGIC = b"TREADLKV"
SUFFIX = ".kvb"
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old is a crashed writer's, not a live one's
# magic, version, namespace, model fingerprint, dtype, kernels, block size, tokens, block hash, payload bytes, crc32
_HEADER = struct.Struct("<8sI16s16s8s8sII16sQI")
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True, slots=True)
class BlockFileIdentity:
    """What every block file of one server's cache shares; a file that differs is not this cache's."""

    namespace: bytes  # 16 bytes: the prefix hash chain's root (binds everything below and the KV code)
    model_fingerprint: bytes  # 16 bytes
    dtype: str
    kernels: str
    block_size: int
    block_shape: tuple[int, ...]  # the payload array's shape and type
    storage_type: type

    @property
    def payload_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.storage_type).itemsize

    def header(self, block_hash: BlockHash, checksum: int) -> bytes:
        return _HEADER.pack(MAGIC, FORMAT_VERSION, self.namespace, self.model_fingerprint, self.dtype.encode(),
                            self.kernels.encode(), self.block_size, self.block_size, block_hash,
                            self.payload_bytes, checksum)

    def mismatch(self, header: bytes, block_hash: BlockHash | None) -> tuple[str | None, int]:
        """(why a file with this header is not a block of this cache, or None; its checksum)."""
        if len(header) < _HEADER.size:
            return "truncated", 0
        (magic, version, namespace, model, dtype, kernels, block_size, num_tokens, stored_hash, payload_bytes,
         checksum) = _HEADER.unpack(header[: _HEADER.size])
        if magic != MAGIC:
            return "not a treadle KV block file", 0
        if version != FORMAT_VERSION:
            return f"format version {version}, not {FORMAT_VERSION}", 0
        if model != self.model_fingerprint:
            return "another model file", 0
        if dtype.rstrip(b"\0").decode(errors="replace") != self.dtype:
            return "another KV dtype", 0
        if kernels.rstrip(b"\0").decode(errors="replace") != self.kernels:
            return "another kernel mode", 0
        if block_size != self.block_size or num_tokens != self.block_size:
            return "another block size", 0
        if payload_bytes != self.payload_bytes:
            return "another KV layout", 0
        if namespace != self.namespace:
            return "KV computed by other code", 0
        if block_hash is not None and stored_hash != block_hash:
            return "named after another block", 0
        return None, checksum


@dataclass(slots=True)
class DiskTierStats:
    """What the disk tier counts itself (its hits and misses are counted by `PrefixTiers`)."""

    num_evictions: int = 0
    num_rejected: int = 0  # files removed as foreign, truncated or corrupt
    num_dropped_writes: int = 0  # not written: the queue of pending writes was full
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int, identity: BlockFileIdentity,
                 max_pending_bytes: int = 256 << 20) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.identity = identity
        self.file_bytes = _HEADER.size + identity.payload_bytes
        self.max_pending_bytes = max_pending_bytes
        self.stats = DiskTierStats()
        self._lock = threading.Condition()
        self._index: OrderedDict[BlockHash, None] = OrderedDict()  # files known here, least recently used first
        self._pending: dict[BlockHash, np.ndarray] = {}  # queued or being written; readable meanwhile
        self._queue: deque[BlockHash] = deque()
        self._num_writing = 0
        self._reported: set[str] = set()  # kinds of rejected files already logged
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="treadle-kv-disk", daemon=True)
        self._writer.start()

    # ---- any thread: what is held --------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return len(self._index) * self.file_bytes

    @property
    def num_pending_bytes(self) -> int:
        return len(self._pending) * self.identity.payload_bytes

    def contains(self, block_hash: BlockHash) -> bool:
        """Held, queued, or written by another server into the same directory."""
        with self._lock:
            if block_hash in self._pending or block_hash in self._index:
                return True
        return self._path(block_hash).exists()

    # ---- the engine thread -------------------------------------------------------------------------

    def read(self, block_hash: BlockHash) -> np.ndarray | None:
        """The block, or None if it is not here (or its file proves foreign or corrupt: then removed)."""
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            return pending
        started = time.perf_counter()
        path = self._path(block_hash)
        block = np.empty(self.identity.block_shape, dtype=self.identity.storage_type)
        try:
            with path.open("rb") as f:
                header = f.read(_HEADER.size)
                why, checksum = self.identity.mismatch(header, block_hash)
                if why is None:
                    if f.readinto(memoryview(block).cast("B")) != block.nbytes or f.read(1):
                        why = "truncated or too long"
                    elif zlib.crc32(block) != checksum:
                        why = "checksum mismatch"
        except FileNotFoundError:  # never here, or another server evicted it
            self._forget(block_hash)
            return None
        except OSError as exc:
            why = f"unreadable ({exc.strerror})"
        if why is not None:
            self._reject(path, why)
            self._forget(block_hash)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used, for this server's order after a restart and for others
        with self._lock:
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
        self.stats.read_seconds += time.perf_counter() - started
        return block

    def write(self, block_hash: BlockHash, block: np.ndarray, bounded: bool = True) -> bool:
        """Queue a block for writing (the array is handed over, not copied); False if it is already
        here or the queue is full (then it is dropped: the disk is a cache). `bounded=False` queues
        it whatever is pending (a shutdown's last writes)."""
        with self._lock:
            if self._closed or block_hash in self._pending or block_hash in self._index:
                return False
            if bounded and self.num_pending_bytes + block.nbytes > self.max_pending_bytes:
                self.stats.num_dropped_writes += 1
                return False
            self._pending[block_hash] = block
            self._queue.append(block_hash)
            self._lock.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block is written, at most `timeout` seconds; True if all were."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._num_writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def clear(self) -> int:
        """Drop what is queued and remove every file of this cache; returns the blocks removed."""
        with self._lock:
            self._queue.clear()
            self._pending.clear()
            hashes = list(self._index)
            self._index.clear()
        for block_hash in hashes:
            self._unlink(self._path(block_hash))
        for path in self._block_files():  # files other servers wrote for this same cache
            header = _read_header(path)
            if header is not None and self.identity.mismatch(header, None)[0] is None:
                self._unlink(path)
                hashes.append(b"")
        return len(hashes)

    def close(self, timeout: float) -> bool:
        """Write what is queued (at most `timeout` seconds), then stop the writer; True if all was written."""
        written = self.flush(timeout)
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._pending.clear()
            self._lock.notify_all()
        self._writer.join(timeout=1.0)
        return written

    # ---- the writer thread -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                block_hash = self._queue.popleft()
                block = self._pending[block_hash]
                self._num_writing += 1
            try:
                self._write_file(block_hash, block)
                self._evict_over_budget()
            except OSError as exc:  # a full or read-only disk: the cache goes without this block
                self._report("a block could not be written", f"{exc.strerror}")
            finally:
                with self._lock:
                    self._pending.pop(block_hash, None)
                    self._num_writing -= 1
                    self._lock.notify_all()

    def _write_file(self, block_hash: BlockHash, block: np.ndarray) -> None:
        started = time.perf_counter()
        path = self._path(block_hash)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        payload = np.ascontiguousarray(block, dtype=self.identity.storage_type)
        try:
            with temporary.open("wb") as f:
                f.write(self.identity.header(block_hash, zlib.crc32(payload)))
                f.write(memoryview(payload).cast("B"))
            os.replace(temporary, path)
        except BaseException:
            self._unlink(temporary)
            raise
        with self._lock:
            if not self._closed:
                self._index[block_hash] = None
        self.stats.bytes_written += self.file_bytes
        self.stats.write_seconds += time.perf_counter() - started

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if len(self._index) * self.file_bytes <= self.max_bytes or not self._index:
                    return
                block_hash, _ = self._index.popitem(last=False)
            self._unlink(self._path(block_hash))
            self.stats.num_evictions += 1

    # ---- files ---------------------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def _block_files(self) -> list[Path]:
        try:
            return [p for p in self.directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")]
        except OSError:
            return []

    def _scan(self) -> None:
        """Index this cache's files, least recently used first; remove foreign, truncated and stale ones."""
        found: list[tuple[float, BlockHash]] = []
        now = time.time()
        for path in self.directory.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                        self._unlink(path)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(path.name[: -len(SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                self._reject(path, "not named after a block")
                continue
            header = _read_header(path)
            why = "unreadable" if header is None else self.identity.mismatch(header, block_hash)[0]
            if why is None and stat.st_size != self.file_bytes:
                why = "truncated or too long"
            if why is not None:
                self._reject(path, why)
                continue
            found.append((stat.st_mtime, block_hash))
        found.sort()
        self._index.update((block_hash, None) for _, block_hash in found)
        self._evict_over_budget()

    def _reject(self, path: Path, why: str) -> None:
        self.stats.num_rejected += 1
        self._report(f"ignored and removed a block file: {why}", str(path))
        self._unlink(path)

    def _report(self, what: str, detail: str) -> None:
        """Log each kind of trouble once: a directory of foreign files must not flood the log."""
        if what not in self._reported:
            self._reported.add(what)
            log.warning("prefix cache on disk: %s (%s; not logged again)", what, detail)

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._index.pop(block_hash, None)

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()


def _read_header(path: Path) -> bytes | None:
    try:
        with path.open("rb") as f:
            return f.read(_HEADER.size)
    except OSError:
        return None

