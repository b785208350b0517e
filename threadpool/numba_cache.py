"""Where numba keeps this project's compiled kernels: <base>/<hash of every kernel package's source>.

numba invalidates a cached kernel only when its own file changes, not when a function or intrinsic it
inlines from another file does: a kernel cached before such an edit runs the old code (a stale cache
once produced garbage on Qwen2.5). So the directory is named after the sources of all three kernel
packages, and `decoding` and `threadpool` point numba there when they are imported, before any of
their kernels is compiled (`use_numba_cache()` in their __init__): an edit anywhere starts a fresh
cache, whether the code runs under `treadle`, the tests, a benchmark or a script of one's own. (kvcache
knows nothing of threadpool: a script that compiles kvcache's kernels without importing either of the
others first should call `use_numba_cache()` itself, as tests/conftest.py does.) <base> is NUMBA_CACHE_DIR
where set, else .numba_cache beside the packages; the hash is added to it either way.

The Makefile prints the directory (`python3 threadpool/numba_cache.py`: as a file, not `-m`, so that the
package, which loads numba, is not imported by a Python that lacks it). Standard library only, so that
it can run before numba loads; where numba has loaded already, its configuration is updated too.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KERNEL_PACKAGES = ("decoding", "kvcache", "threadpool")


def kernel_sources_hash(root: Path = REPO) -> str:
    digest = hashlib.sha1()
    for package in KERNEL_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


_HASH = kernel_sources_hash()


def numba_cache_dir(root: Path = REPO) -> Path:
    """NUMBA_CACHE_DIR (or .numba_cache) with this source tree's hash as its last component."""
    source_hash = _HASH if root == REPO else kernel_sources_hash(root)
    base = Path(os.environ.get("NUMBA_CACHE_DIR") or root / ".numba_cache")
    return base if base.name == source_hash else base / source_hash


def use_numba_cache(root: Path = REPO) -> None:
    """Point numba (and the processes this one starts) at this source tree's cache directory."""
    directory = str(numba_cache_dir(root))
    os.environ["NUMBA_CACHE_DIR"] = directory
    if "numba" in sys.modules:  # loaded already: its configuration was read from the environment then
        sys.modules["numba"].config.CACHE_DIR = directory


if __name__ == "__main__":
    print(numba_cache_dir())
