from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _kernel_sources_hash() -> str:
    """Same naming as the Makefile: numba does not see edits to kernels called across files."""
    digest = hashlib.sha1()
    for package in ("decoding", "kvcache", "threadpool"):
        for path in sorted((ROOT / package).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


# numba compiles kernels once and keeps them here, so a second run of the suite skips compilation.
os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache" / _kernel_sources_hash()))

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="session")
def default_model():
    from decoding import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_gguf

    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")
