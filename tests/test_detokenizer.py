import pytest

from decoding.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "数学是研究数量、结构以及空间等概念的一门学科。",
    "日本語のテキストと한국어 텍스트",
    "emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "Ünïcödé àccents — “quotes” and ellipsis…",
    "def f(x):\n\treturn x ** 2  # square\n",
    "   leading spaces and trailing   ",
    "ascii then 中文 then ascii 123.45",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(default_model, text):
    tok = default_model.tokenizer
    ids = tok.encode(text)
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas), deltas


def test_multi_token_characters_are_held_until_complete(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("😀")
    assert len(ids) > 1, "the test needs a character that spans several tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "😀"


def test_prompt_tail_gives_context_but_no_prompt_text_leaks(default_model):
    tok = default_model.tokenizer
    prompt = tok.encode("The answer is")
    completion = tok.encode(" forty-two, 四十二.")
    deltas = stream(IncrementalDetokenizer(tok, prompt), completion)
    assert "".join(deltas) == " forty-two, 四十二."


def test_prompt_ending_inside_a_character_does_not_leak_it(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("say 🎉🎉")
    split = len(ids) - 1  # the prompt ends inside the last emoji
    deltas = stream(IncrementalDetokenizer(tok, ids[:split]), ids[split:] + tok.encode(" ok"))
    text = "".join(deltas)
    assert "say" not in text and "\ufffd" not in text and text.endswith(" ok")


def test_special_tokens_are_skipped_by_default_and_kept_on_request(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("hi<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "hi"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hi<|im_end|>"


def test_bytes_that_never_form_a_character_are_flushed_at_the_end(default_model):
    tok = default_model.tokenizer
    partial = tok.encode("😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(t) for t in partial) == ""
    assert detok.flush() == tok.decode(partial)


def test_long_streams_keep_a_bounded_window(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("word " * 500)
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, ids)) == "word " * 500
    assert len(detok._ids) < 40
