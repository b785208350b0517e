"""Tokenizer: built with the `tokenizers` library from GGUF metadata (byte-level BPE, or a SentencePiece
vocabulary with scores) or from a tokenizer.json.

GGUF files name their pre-tokenizer (`tokenizer.ggml.pre`); we rebuild the same split llama.cpp uses
for that name. SmolLM2's (`smollm`) splits every digit off individually before the GPT-2 byte-level
split, as its tokenizer.json does; the plain GPT-2 split would merge a space run into the digit's
word ("x  5" → [104, 216, 216, 37] instead of [104, 256, 37]).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .chat_template import ChatTemplate
from .errors import ModelLoadError, TemplateError
from .gguf_loader import GGUFTokenizerData

log = logging.getLogger(__name__)

_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, the tokenizer.json of Qwen2/2.5): llama 3's,
# but every digit alone
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


_WHOLE_WORD_FIRST_PRE_TOKENIZERS = ("llama-bpe", "llama3", "llama-v3")


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])
    if name in ("llama-bpe", "llama3", "llama-v3", "qwen2"):
        pattern = _QWEN2_SPLIT if name == "qwen2" else _LLAMA3_SPLIT
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, _byte_level(use_regex=False)])
    if name not in ("default", "gpt-2", "gpt2"):
        log.warning("pre-tokenizer %r is not known to treadle: using the GPT-2 byte-level split", name)
    return _byte_level()


def _from_gguf(data: GGUFTokenizerData) -> HFTokenizer:
    if data.model == "gpt2":
        vocab = {token: i for i, token in enumerate(data.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in data.merges]
        # Llama 3's pre-tokenizers look a whole word up before merging (llama.cpp's ignore_merges, as
        # tiktoken does): a word that is itself a token stays one even where the merges would not build it
        ignore_merges = data.pre in _WHOLE_WORD_FIRST_PRE_TOKENIZERS
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=ignore_merges))  # fmt: skip
        tok.pre_tokenizer = _pre_tokenizer(data.pre)
        tok.decoder = decoders.ByteLevel()
    elif data.model == "llama" and data.scores:
        tok = _sentencepiece_bpe(data)
    else:
        raise ModelLoadError(
            f"tokenizer model {data.model!r} is not supported from GGUF (byte-level BPE 'gpt2' and SentencePiece "
            "'llama' with scores are); load the Hugging Face directory with its tokenizer.json instead"
        )
    types = data.token_types or [1] * len(data.tokens)
    # llama.cpp parses the text of control and unknown tokens (`<unk>`) as those tokens
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(data.tokens, types, strict=False)
                if ty in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)]  # fmt: skip
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(data.tokens, types, strict=False)
            if ty == _TOKEN_USER_DEFINED]
    tok.add_special_tokens(specials)
    tok.add_tokens(user)
    return tok


def _sentencepiece_bpe(data: GGUFTokenizerData) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (GGUF tokenizer model `llama`: pieces with scores, "▁" for a
    space, bytes as <0xNN> pieces) as a `tokenizers` BPE: merges ranked by the score of the piece they
    make, unknown characters spelled in bytes."""
    vocab = {token: i for i, token in enumerate(data.tokens)}
    unknown = data.tokens[data.unknown_token_id] if data.unknown_token_id is not None else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(data.tokens, data.scores), unk_token=unknown,
                                 fuse_unk=True, byte_fallback=True))
    escape_spaces = normalizers.Replace(" ", "\u2581")
    # llama.cpp's add_space_prefix: a space before the text and after each special token (Llama 2's
    # "▁Hello"); the normalizer runs on each stretch between special tokens, which is exactly that
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), escape_spaces]) if data.add_space_prefix
                      else escape_spaces)  # fmt: skip
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges: every split of a piece into two pieces of the vocabulary, ranked by the
    score of the piece they make (highest first), then by the longer left and right parts; within one
    piece, by the ids of its parts (as the SentencePiece-to-BPE conversions of tokenizers do)."""
    ids = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores, strict=False):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


class Tokenizer:
    """Text ↔ token ids, special tokens and the chat template of one model."""

    def __init__(self, backend: HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 add_bos_token: bool, chat_template: str | None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = self._token_text(bos_token_id)
        self.eos_token = self._token_text(eos_token_ids[0] if eos_token_ids else None)
        self.special_token_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self._chat_template_source = chat_template
        self._chat_template: ChatTemplate | None = None

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @classmethod
    def from_gguf(cls, data: GGUFTokenizerData, eos_token_ids: tuple[int, ...]) -> Tokenizer:
        return cls(_from_gguf(data), data.bos_token_id, eos_token_ids, data.add_bos_token, data.chat_template)

    @classmethod
    def from_hf_directory(cls, directory: Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> Tokenizer:
        try:
            backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:
            raise ModelLoadError(f"{directory / 'tokenizer.json'} is not a readable tokenizer ({exc})") from None
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, bos_token_id, eos_token_ids, bool(config.get("add_bos_token", False)), template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` maps to its single id.

        With `add_special_tokens`, BOS is prepended when the model asks for it (`add_bos_token`).
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered by the chat template. The template writes the special
        tokens it wants (BOS among them), so none are added: a model that adds BOS would get two."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template_source)

    @property
    def chat_template_source(self) -> str | None:
        return self._chat_template_source

    def use_chat_template(self, source: str) -> None:
        """Replace the model's chat template with `source`, once it renders a sample conversation (with
        a system turn, an answer and a question after it); TemplateError says why it does not."""
        previous, previous_compiled = self._chat_template_source, self._chat_template
        self._chat_template_source, self._chat_template = source, None
        try:
            self.apply_chat_template([{"role": "system", "content": "You are helpful."},
                                      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "2+2?"}])  # fmt: skip
        except TemplateError:
            self._chat_template_source, self._chat_template = previous, previous_compiled
            raise

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The conversation rendered by the model's own template, as transformers renders it."""
        if not self._chat_template_source:
            raise TemplateError("this model has no chat template; use /v1/completions with a plain prompt")
        if self._chat_template is None:
            self._chat_template = ChatTemplate(
                self._chat_template_source, {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
            )
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)
