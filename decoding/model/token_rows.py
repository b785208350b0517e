"""A step's token-embedding rows, read from the model file rather than through its memory map.

The token embedding stays in the file as stored (the fast kernels' repacked copy holds only the
matrices a step multiplies), and a step needs one row per token. Looked up through the map, each row
costs more resident memory than itself: the kernel maps the cached pages around a faulting one too
(fault-around, 64 KiB), so after a few thousand distinct tokens most of the embedding counts in the
process's RSS (152 of Llama-3.1-8B's 282 MiB after a benchmark's prompts) although the step reads
2.3 KB a token. `TokenRows` reads the rows with `preadv` into a buffer of its own: the page cache
keeps them, the process holds only the buffer. An embedding that is not a file's (a converted model)
is indexed in memory.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np


def _file_extent(array: np.ndarray) -> tuple[Path, int] | None:
    """The file an array's memory maps and the offset of its first byte there, from /proc/self/maps;
    None for memory that maps no file."""
    address = array.ctypes.data
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        begin, end = (int(a, 16) for a in fields[0].split("-"))
        if begin <= address < end:
            if len(fields) < 6 or not fields[5].startswith("/") or fields[4] == "0" or "w" in fields[1]:
                return None  # anonymous, special, or writable: the file may not hold what the memory does
            path = Path(fields[5])
            return (path, int(fields[2], 16) + address - begin) if path.is_file() else None
    return None


class TokenRows:
    """Gathers embedding rows by token id: `gather(token_ids)` → (n, row_bytes) uint8, the rows as stored."""

    def __init__(self, embedding: np.ndarray) -> None:
        """`embedding`: (vocab, row_bytes) uint8, C-contiguous."""
        if embedding.dtype != np.uint8 or embedding.ndim != 2 or not embedding.flags.c_contiguous:
            raise ValueError("the embedding must be a C-contiguous (vocab, row_bytes) uint8 array")
        self.embedding = embedding
        self.row_bytes = embedding.shape[1]
        extent = _file_extent(embedding) if embedding.size else None
        self._path = extent[0] if extent else None
        self._fd = os.open(extent[0], os.O_RDONLY) if extent else -1
        self._offset = extent[1] if extent else 0
        self._close = weakref.finalize(self, os.close, self._fd) if extent else None  # at close() or with self
        self._buffer = np.empty((0, self.row_bytes), dtype=np.uint8)
        self._rows: list[memoryview] = []

    @property
    def reads_file(self) -> bool:
        return self._fd >= 0

    def gather(self, token_ids: np.ndarray) -> np.ndarray:
        """The rows of `token_ids` in order: a view of a buffer this object reuses at the next call."""
        n = token_ids.shape[0]
        if self._fd < 0:
            return self.embedding[token_ids]
        if n > self._buffer.shape[0]:
            self._buffer = np.empty((max(n, 2 * self._buffer.shape[0]), self.row_bytes), dtype=np.uint8)
            self._rows = [memoryview(row) for row in self._buffer]
        fd, offset, row_bytes, vocab = self._fd, self._offset, self.row_bytes, self.embedding.shape[0]
        for i, token in enumerate(token_ids.tolist()):
            if not 0 <= token < vocab:
                raise IndexError(f"token id {token} is outside the vocabulary of {vocab}")
            if os.preadv(fd, [self._rows[i]], offset + token * row_bytes) != row_bytes:
                raise OSError(f"short read of token {token}'s embedding row from {self._path}")
        return self._buffer[:n]

    def close(self) -> None:
        """Close the file; later rows come from the map (a closed descriptor's number may name another file)."""
        if self._close is not None:
            self._close()
        self._fd = -1
