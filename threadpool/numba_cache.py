"""Where numba keeps compiled kernels: .numba_cache/<hash of every kernel package's source>.

numba invalidates a cached kernel only when its own file changes, not when a kernel or intrinsic it calls
in another file does, so the directory is named after all of them: an edit anywhere starts a fresh cache.
The Makefile (`python3 -m bench.numba_cache`), the `treadle` command (app/cli.py), tests/conftest.py
and bench/ray_replay.py all name it here. Standard library only, and nothing that imports numba: the variable must be set before numba loads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KERNEL_PACKAGES = ("decoding", "kvcache", "threadpool")


def kernel_sources_hash(root: Path = REPO) -> str:
    digest = hashlib.sha1()
    for package in KERNEL_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def use_numba_cache(root: Path = REPO) -> None:
    """Point numba at this source tree's cache, unless NUMBA_CACHE_DIR is set already."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(root / ".numba_cache" / kernel_sources_hash(root)))


if __name__ == "__main__":
    print(REPO / ".numba_cache" / kernel_sources_hash())
