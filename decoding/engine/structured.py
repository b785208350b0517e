"""Constrained decoding (structured output): a request's grammar, compiled once, masks its logits.

The one place treadle talks to llguidance. A request's constraint — a JSON schema, any JSON object,
a regex, a choice of strings, a Lark grammar — becomes an llguidance grammar (`compile`), checked
against the model's tokenizer and cached by its text; each constrained sequence gets its own matcher
(`Guide.matcher`, a copy of the cached one). Before a step's rows are sampled, `apply_masks` sets the
logits of every token the grammar forbids to -inf; after, the sequence's matcher consumes the token.

Generated JSON has a fixed layout: `", "` between items, `": "` after keys and no other whitespace,
so a schema can never be satisfied by an endless run of spaces or newlines (the failure users of
other servers report most). Numbers are held to MAX_NUMBER_DIGITS digits in a row (`JsonRunGuard`):
a JSON grammar allows endless fraction digits, which a sampled answer otherwise wanders into until
max_tokens cuts it off invalid, and no float carries more than 17 significant digits anyway.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_NUMBER_DIGITS = 24
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHED_GRAMMARS = 256


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request constrains its output to: `kind` one of KINDS, `spec` its text (a JSON schema as
    JSON text, a regex, the choices as a JSON list, a Lark grammar; "" for json_object)."""

    kind: str
    spec: str = ""
    field: str = field(default="response_format", compare=False)  # the request field it came from

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint."""
        from llguidance import LLMatcher

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_LAYOUT)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            choices = json.loads(self.spec)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.spec)
        raise StructuredOutputError(f"unknown constraint kind {self.kind!r}")


class Guide:
    """The model's tokenizer as llguidance sees it (built on first use: about a second for a 150k
    vocabulary) and the compiled grammars, by their text."""

    def __init__(self, backend: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """`backend`: the model's `tokenizers.Tokenizer`, serialised for llguidance only when a first
        constraint needs it (nothing at engine start)."""
        self._backend = backend
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._token_texts: list[str] | None = None
        self._starts_with_digit: np.ndarray | None = None
        self._digit_words: np.ndarray | None = None

    @classmethod
    def for_model(cls, model: Any) -> Guide:
        return cls(model.tokenizer.backend, model.config.vocab_size, model.config.eos_token_ids)

    def digit_start_words(self) -> np.ndarray:
        """The tokens that start with a digit, as a row of the bitmask's int32 words."""
        if self._digit_words is None:
            starts = self.token_texts()[1]
            padded = np.zeros(-(-self.vocab_size // 32) * 32, dtype=bool)
            padded[: starts.shape[0]] = starts
            self._digit_words = np.packbits(padded, bitorder="little").view(np.int32)
        return self._digit_words

    def token_texts(self) -> tuple[list[str], np.ndarray]:
        """Each token's vocabulary entry (ASCII digits, quotes and backslashes appear as themselves in
        byte-level and SentencePiece vocabularies alike), and whether it starts with a digit."""
        if self._token_texts is None:
            texts = [self._backend.id_to_token(i) or "" for i in range(self.vocab_size)]
            self._starts_with_digit = np.array([t[:1].isdigit() and t[:1].isascii() for t in texts])
            self._token_texts = texts
        return self._token_texts, self._starts_with_digit

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            self._tokenizer = LLTokenizer(self._backend.to_str(), n_vocab=self.vocab_size,
                                          eos_token=self._eos_token_ids or None)  # fmt: skip
        return self._tokenizer

    def compile(self, constraint: Constraint) -> Any:
        """The constraint's matcher in its initial state, compiled once and kept (by its text), or
        StructuredOutputError saying why it cannot be compiled."""
        from llguidance import LLMatcher

        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
            tokenizer = self._ll_tokenizer()
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as exc:
            raise StructuredOutputError(str(exc)) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise StructuredOutputError(messages[0] if messages else "the grammar does not compile")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(matcher.get_error())
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one sequence (a copy of the compiled one: cheap)."""
        return self.compile(constraint).deep_copy()

    def text_state(self, constraint: Constraint, text: str) -> str:
        """Where `text` stands under the constraint: "complete" (an answer the grammar accepts whole),
        "prefix" (a start it can still continue) or "invalid". Grammars are over bytes, so any
        tokenization of the text reads the same."""
        matcher = self.matcher(constraint)
        tokens = self._ll_tokenizer().tokenize_str(text)
        if matcher.validate_tokens(tokens) < len(tokens) or not matcher.consume_tokens(tokens):
            return "invalid"
        return "complete" if matcher.is_accepting() else "prefix"


class JsonRunGuard:
    """Where a JSON answer stands outside its strings: how many digits end it (a number being written)."""

    __slots__ = ("digits", "escaped", "in_string")

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False
        self.digits = 0

    def add(self, text: str) -> None:
        for char in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string, self.digits = True, 0
            else:
                self.digits = self.digits + 1 if char.isdigit() else 0

    def copy(self) -> JsonRunGuard:
        other = JsonRunGuard()
        other.in_string, other.escaped, other.digits = self.in_string, self.escaped, self.digits
        return other

    @property
    def number_is_full(self) -> bool:
        return not self.in_string and self.digits >= MAX_NUMBER_DIGITS


@dataclass(slots=True)
class GrammarState:
    """One choice's progress through its grammar: llguidance's matcher and, for a JSON answer, where it
    stands outside its strings."""

    matcher: Any  # llguidance.LLMatcher
    json_guard: JsonRunGuard | None = None
    also_allowed: int | None = None  # a token allowed beside the grammar's next ones (a thinking model's opening)
    ends_reasoning: bool = False  # it forces the end of a thinking: once complete, the answer's own rules apply

    @classmethod
    def start(cls, guide: Guide, constraint: Constraint, is_json: bool | None = None,
              also_allowed: int | None = None, ends_reasoning: bool = False) -> GrammarState:  # fmt: skip
        """`is_json`: whether to guard number runs (default: the constraint is a JSON one)."""
        is_json = constraint.kind in ("json", "json_object") if is_json is None else is_json
        return cls(guide.matcher(constraint), JsonRunGuard() if is_json else None, also_allowed, ends_reasoning)

    def consume(self, token: int, guide: Guide) -> bool:
        """Advance by a drawn token; False where the grammar refuses it."""
        if not self.matcher.consume_token(token):
            return False
        if self.json_guard is not None:
            self.json_guard.add(guide.token_texts()[0][token])
        return True

    @property
    def is_complete(self) -> bool:
        """The grammar accepts nothing after what it consumed."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() or "dead end"


def apply_masks(logits: np.ndarray, constrained: list[tuple[int, GrammarState, list[int]]],
                guide: Guide) -> list[int]:  # fmt: skip
    """Set to -inf the logits each row's matcher forbids (and, for JSON, digits past a full number);
    `constrained`: (row of `logits`, the choice's grammar state, draft tokens). A sequence with
    draft tokens (speculative decoding) owns that row and one more per draft: row j gets the mask of
    the state after drafts[:j] (the matcher consumes the drafts the grammar allows, then rolls them
    back); rows after a draft the grammar refuses only copy the row before, as verification stops
    there. Returns the rows whose matcher allows no token at all (a dead end: the caller ends them).

    The masks are filled one row after another on the engine thread, after the model step, and
    applied by a numba loop over their 32-bit words: llguidance's parallel fill would put its threads
    beside the pool's spinning ones on the same cores (docs/performance.md has the measurements).
    """
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    if not constrained:
        return []
    bitmask = allocate_token_bitmask(sum(1 + len(drafts) for *_, drafts in constrained), guide.vocab_size)
    rows: list[int] = []
    owners: list[Any] = []
    for first_row, state, drafts in constrained:
        matcher, guard = state.matcher, state.json_guard
        num_valid = matcher.validate_tokens(drafts) if drafts else 0
        for j in range(len(drafts) + 1):
            i = len(rows)
            if j <= num_valid:
                fill_next_token_bitmask(matcher, bitmask, i)
                if guard is not None and guard.number_is_full:
                    _forbid_digits(bitmask[i], guide)
                if j == 0 and state.also_allowed is not None:
                    bitmask[i].view(np.uint32)[state.also_allowed // 32] |= np.uint32(1 << (state.also_allowed % 32))
                if j < num_valid:
                    matcher.consume_token(drafts[j])
                    if guard is not None:
                        guard = guard.copy()
                        guard.add(guide.token_texts()[0][drafts[j]])
            else:
                bitmask[i] = bitmask[i - 1]
            rows.append(first_row + j)
            owners.append(matcher)
        if num_valid:
            matcher.rollback(num_valid)
    row_array = np.array(rows, dtype=np.int64)
    allowed_counts = np.zeros(len(rows), dtype=np.int64)
    _apply_bitmask(logits, row_array, bitmask, allowed_counts)
    return [rows[i] for i, matcher in enumerate(owners) if allowed_counts[i] == 0 or matcher.is_error()]


def _forbid_digits(words: np.ndarray, guide: Guide) -> None:
    """Clear the bits of tokens that start with a digit, unless that leaves none (the grammar needs one)."""
    digit_words = guide.digit_start_words()
    cleared = words & ~digit_words
    if cleared.any():
        words[:] = cleared


@njit(nogil=True, cache=True)
def _apply_bitmask(logits, rows, bitmask, allowed_counts):  # type: ignore[no-untyped-def]
    vocab = logits.shape[1]
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        count = 0
        for w in range(bitmask.shape[1]):
            bits = bitmask[i, w]
            first = 32 * w
            if first + 32 <= vocab:
                if bits == -1:  # every token of the word allowed
                    count += 32
                    continue
                if bits == 0:  # none: most words of a constrained row
                    row[first : first + 32] = -np.inf
                    continue
            for b in range(min(32, vocab - first)):
                if (bits >> b) & 1:
                    count += 1
                else:
                    row[first + b] = -np.inf
        allowed_counts[i] = count
