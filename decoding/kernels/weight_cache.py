"""The fast kernels' repacked matrices, kept on disk between starts.

Repacking every matrix of a model into the VNNI layout (decoding.kernels.repack) is numpy work over
the whole file at each start: tens of seconds for a 7B model. The first start writes each repacked
matrix, as it is made, into one file of the cache directory; every later start maps that file and
repacks nothing. The file's name is a key of everything its bytes depend on — the model file's
resolved path, size and modification time, and the source of the repacking code — so a changed model
or layout simply misses and writes a new file.

The map is private and never written, so its pages stay those of the page cache: shared, and
reclaimable when memory is short (the kernels read them back from the file). A file is written under
a temporary name and renamed into place whole, so a crash or a second server never leaves a half file
under the final name; a file that does not match what is expected of it is ignored and rewritten.

Layout: a 4 KiB header (MAGIC, format version, offset and length of a JSON index), the arrays at
4 KiB-aligned offsets, the JSON index (the key and each array's offset and length) at the end.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"TREADLEW"
FORMAT_VERSION = 1
ALIGN = 4096
_HEADER = struct.Struct("<8sIQQ")  # magic, version, index offset, index length
WEIGHT_CACHE_DIR_ENV = "TREADLE_WEIGHT_CACHE_DIR"
# the sources whose change changes repacked bytes
_LAYOUT_SOURCES = ("repack.py", "vnni.py", "../model/quant.py")


def weight_cache_dir() -> Path:
    """$TREADLE_WEIGHT_CACHE_DIR, else `weights/` beside the models directory (~/.cache/treadle)."""
    from ..model.catalog import models_dir

    configured = os.environ.get(WEIGHT_CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else models_dir().parent / "weights"


def layout_hash() -> str:
    digest = hashlib.sha1()
    here = Path(__file__).resolve().parent
    for name in _LAYOUT_SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:12]


def cache_key(model_path: Path) -> str:
    """What the repacked bytes of this model file depend on, as a short hash."""
    path = model_path.resolve()
    stat = path.stat()
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{layout_hash()}"
    return hashlib.sha1(identity.encode()).hexdigest()[:16]


def cache_file(model_path: Path, directory: Path | None = None) -> Path:
    return (directory or weight_cache_dir()) / f"{model_path.stem}.{cache_key(model_path)}.packed"


def load(path: Path, sizes: Sequence[int]) -> list[np.ndarray] | None:
    """The arrays of `path` as views of its private map, or None where the file is absent or is not
    `len(sizes)` arrays of these sizes (a foreign, truncated or older file). An array may be empty
    where a size is expected: a matrix whose values the layout cannot hold was not repacked."""
    try:
        with open(path, "rb") as f:
            magic, version, index_offset, index_length = _HEADER.unpack(f.read(_HEADER.size))
            if magic != MAGIC or version != FORMAT_VERSION:
                raise ValueError("not a weight cache of this version")
            f.seek(index_offset)
            index = json.loads(f.read(index_length))
            found = [n for _, n in index["arrays"]]
            if (
                index["key"] != path.name
                or len(found) != len(sizes)
                or any(n not in (0, e) for n, e in zip(found, sizes, strict=True))
            ):
                raise ValueError("made for another model or layout")
            if index_offset + index_length > os.fstat(f.fileno()).st_size:
                raise ValueError("truncated")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        log.warning("ignoring the weight cache %s (%s)", path, exc)
        return None
    buffer = np.frombuffer(mapped, dtype=np.uint8)
    return [buffer[offset : offset + size] for offset, size in index["arrays"]]


def _remove_older_versions(path: Path) -> None:
    """Files of the same model name under other keys: made from an older file or layout."""
    stem = path.name.rsplit(".", 2)[0]  # `<model stem>.<key>.packed`; the stem may hold dots (qwen2.5-7b)
    for other in path.parent.glob(f"{glob.escape(stem)}.*.packed"):
        if other != path and other.name.rsplit(".", 2)[0] == stem:
            log.info("removing %s, the weight cache of an older version of the model", other)
            other.unlink(missing_ok=True)


def build(path: Path, sizes: Sequence[int], make: Callable[[int], np.ndarray]) -> list[np.ndarray]:
    """Write array i = make(i) (sizes[i] bytes, or none) into `path` one at a time, so that no more
    than one made array is held in memory, and return the arrays mapped from the finished file.
    Where the file cannot be written, the arrays are made in memory instead."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as f:
            f.write(b"\0" * ALIGN)
            entries = []
            for i, size in enumerate(sizes):
                array = make(i)
                if array.nbytes not in (0, size):
                    raise ValueError(f"array {i} has {array.nbytes} bytes, {size} expected")
                f.seek(-(-f.tell() // ALIGN) * ALIGN)
                entries.append((f.tell(), array.nbytes))
                f.write(array.data)
            index = json.dumps({"key": path.name, "arrays": entries}).encode()
            index_offset = f.tell()
            f.write(index)
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, index_offset, len(index)))
        temporary.replace(path)
        _remove_older_versions(path)
    except OSError as exc:
        log.warning("the weight cache %s cannot be written (%s): repacking in memory", path, exc)
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        return [make(i) for i in range(len(sizes))]
    mapped = load(path, sizes)
    if mapped is None:
        raise RuntimeError(f"the weight cache {path} just written does not read back")
    return mapped
