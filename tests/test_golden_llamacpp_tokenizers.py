"""treadle's GGUF tokenizers against llama.cpp's on the same files (tests/golden/llamacpp_tokens_*.json,
made by scripts/make_golden_llamacpp_tokenizers.py): equal ids for every string of a corpus of over
200, special-token text parsed. SmolLM2 runs always; the others when their file is here (the real
Q4_K_M files' packages, llama.cpp's vocab-only files in ~/.cache/treadle/llama.cpp-vocab)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoding.model.gguf_loader import read_gguf_tokenizer
from decoding.model.registry import resolve_model_path
from decoding.model.tokenizer import Tokenizer
from tests.real_models import gemma3_270m, qwen25_coder_05b

GOLDEN = Path(__file__).parent / "golden"
VOCAB_DIR = Path.home() / ".cache" / "treadle" / "llama.cpp-vocab"


def _vocab_file(name: str):
    def find(_: Path) -> Path:
        path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
        if not path.exists():
            pytest.skip(f"llama.cpp's {path.name} is not in {VOCAB_DIR} (make golden-llamacpp-tokenizers fetches it)")
        return path

    return find


FILES = {
    "smollm2": lambda _: resolve_model_path("smollm2-135m-instruct")[0],
    "qwen2": qwen25_coder_05b,
    "gemma3": gemma3_270m,
    "llama-bpe": _vocab_file("llama-bpe"),
    "llama-spm": _vocab_file("llama-spm"),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "smollm2" else pytest.mark.slow) for n in FILES]
)
def test_every_string_tokenizes_as_llama_cpp_does(name, tmp_path_factory):
    golden = json.loads((GOLDEN / f"llamacpp_tokens_{name}.json").read_text())
    path = FILES[name](tmp_path_factory.mktemp("tok"))
    data = read_gguf_tokenizer(path)
    tokenizer = Tokenizer.from_gguf(data, ())
    assert len(golden["cases"]) >= 200
    wrong = [(c["text"], tokenizer.encode(c["text"]), c["ids"]) for c in golden["cases"]
             if tokenizer.encode(c["text"]) != c["ids"]]  # fmt: skip
    assert not wrong, f"{len(wrong)} of {len(golden['cases'])} differ from llama.cpp, e.g. {wrong[:3]}"
