"""Incremental detokenization for streaming: text deltas that never split a character.

Byte-level BPE tokens are byte strings: one emoji or CJK character can span several tokens, and a
token can end in the middle of a character. Decoding token by token would emit U+FFFD halves. Like
vLLM and TGI, we decode a short window that starts a few tokens back (so the tokenizer sees each
token's left context) and emit only the text past what was already emitted, holding it back while it
ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# tokens of left context kept in the decode window; enough for any UTF-8 character (≤ 4 bytes)
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed generated token ids one at a time; get back the newly completed text.

    `prompt_ids` seeds the window with the prompt's tail, so the first generated token decodes
    with its real left context and no prompt text leaks into the first delta.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # first token whose text has not been emitted
        self.text = ""  # everything emitted so far

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (another choice of the same prompt)."""
        other = IncrementalDetokenizer(self._tokenizer, (), self._skip_special)
        other._ids, other._prefix_offset, other._read_offset = list(self._ids), self._prefix_offset, self._read_offset
        other.text = self.text
        return other

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        self.text += delta
        return delta

    @property
    def is_mid_character(self) -> bool:
        """Tokens were added whose text is not out yet: a character they began is not complete."""
        return self._read_offset < len(self._ids)

    def flush(self) -> str:
        """At the end of generation: whatever is held back (bytes that never formed a character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _trim(self) -> None:
        """Drop tokens that can no longer be part of the window, so decoding stays O(1) per token."""
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
