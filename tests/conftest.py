from __future__ import annotations

from pathlib import Path

import pytest

from bench.numba_cache import use_numba_cache

# numba compiles kernels once and keeps them there, so a second run of the suite skips compilation.
use_numba_cache()

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="session")
def default_model():
    from decoding import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_gguf

    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")
