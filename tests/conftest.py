from __future__ import annotations

import os
from pathlib import Path

import pytest

# numba compiles kernels once and keeps them here, so a second run of the suite skips compilation.
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".numba_cache"))

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="session")
def default_model():
    from decoding import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_gguf

    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")
