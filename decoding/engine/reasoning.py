"""Reasoning models: where a choice's thinking ends, its budget, and its text apart from the answer.

A thinking model writes `<think> ... </think>` and then its answer. Each choice of a request whose
`SamplingParams.reasoning` is set carries a `ReasoningTracker` that the output stage feeds every
token: it says which part the token's text belongs to (`feed` splits it into reasoning and content,
the markers dropped), counts the thinking tokens, and tells the sampling stage what to hold the next
token to: nothing while the model thinks, the end marker once the budget is spent (ending a character
the budget cut first, as llama.cpp's reasoning-budget sampler does), and the answer's grammar (a
`response_format`, a forced tool call) only after the thinking is over.

Markers are matched as token ids where each is one token of the vocabulary, as text otherwise (held
back while the text seen so far could still be the start of one, across tokens and stream chunks).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from .structured import Constraint

# Tokens a spent budget waits for a character it cut in half to end, before forcing the end marker anyway.
MAX_CHARACTER_WAIT_TOKENS = 4


class Phase(enum.Enum):
    MAYBE = "maybe"  # nothing written yet: the model may open its thinking with its first token
    THINKING = "thinking"
    ANSWERING = "answering"


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    """The text that opens and closes a model's thinking, and the token that spells each where one does."""

    start: str = "<think>"
    end: str = "</think>"
    start_id: int | None = None
    end_id: int | None = None

    def end_constraint(self) -> Constraint:
        """The grammar that forces the end marker (the spent budget's)."""
        spelled = f"<[{self.end_id}]>" if self.end_id is not None else json.dumps(self.end)
        return Constraint("grammar", f"start: {spelled}\n", "thinking_token_budget")


@dataclass(frozen=True, slots=True)
class ReasoningParams:
    """How a request's choices think: the markers, the phase they start in (the prompt may have opened
    or closed the thinking already; `MAYBE` lets the model open it), and the most thinking tokens
    (None: no limit; 0: the end marker comes first)."""

    markers: ReasoningMarkers
    initial: Phase = Phase.MAYBE
    budget: int | None = None


class ReasoningTracker:
    """One choice's progress through its thinking."""

    __slots__ = ("_pending", "_past_opening", "num_tokens", "num_tokens_past_budget", "params", "phase")

    def __init__(self, params: ReasoningParams) -> None:
        self.params = params
        self.phase = params.initial
        self.num_tokens = 0  # tokens of the thinking, its markers included
        self.num_tokens_past_budget = 0
        self._pending = ""  # text that may be the start of a marker
        self._past_opening = False

    def copy(self) -> ReasoningTracker:
        other = ReasoningTracker(self.params)
        other.phase, other.num_tokens, other._pending = self.phase, self.num_tokens, self._pending
        other.num_tokens_past_budget, other._past_opening = self.num_tokens_past_budget, self._past_opening
        return other

    @property
    def is_thinking(self) -> bool:
        return self.phase is Phase.THINKING

    @property
    def is_answering(self) -> bool:
        return self.phase is Phase.ANSWERING

    @property
    def is_maybe(self) -> bool:
        return self.phase is Phase.MAYBE

    @property
    def markers(self) -> ReasoningMarkers:
        return self.params.markers

    def budget_spent(self, is_mid_character: bool) -> bool:
        """The thinking must end now: its budget is spent, and no character is half written (or the
        wait for its end is over)."""
        budget = self.params.budget
        if not self.is_thinking or budget is None or self.num_tokens < budget:
            return False
        return not is_mid_character or self.num_tokens_past_budget >= MAX_CHARACTER_WAIT_TOKENS

    def draft_room(self, answer_constrained: bool) -> int | None:
        """How many draft tokens a decode step may verify without the thinking's end or its budget falling
        inside the step where the next token's grammar would change (None: no limit). The end marker as
        the step's last token is fine: its grammar applies from the next step."""
        if self.is_answering:
            return None
        if self.is_maybe:
            return 0
        room: int | None = None
        if self.params.budget is not None:
            room = max(0, self.params.budget - self.num_tokens - 1)
        if answer_constrained and self.markers.end_id is None:
            room = 0  # an end written as text could complete at any token
        return room

    def cut_drafts(self, drafts: list[int], answer_constrained: bool) -> list[int]:
        """Drafts up to (not including) an end-marker token, where the answer's grammar waits for it."""
        end_id = self.markers.end_id
        if answer_constrained and self.is_thinking and end_id is not None and end_id in drafts:
            return drafts[: drafts.index(end_id)]
        return drafts

    def feed(self, token: int | None, text: str) -> tuple[str, str]:
        """The choice produced `token`, whose text is `text` (None: text its last tokens left, at its end):
        returns (reasoning, content) of it."""
        if self.is_answering:
            return "", text
        markers = self.markers
        if self.is_thinking and token is not None:
            self.num_tokens += 1
            if self.params.budget is not None and self.num_tokens > self.params.budget:
                self.num_tokens_past_budget += 1
        if self.is_maybe:
            if markers.start_id is not None and token is not None:
                if token == markers.start_id:
                    self.phase, self.num_tokens, self._past_opening = Phase.THINKING, 1, True
                    return "", ""
                self.phase = Phase.ANSWERING
                return "", text
            return self._open_by_text(text)
        if markers.end_id is not None:
            if token is None:
                return self._reasoning(text), ""
            if token == markers.end_id:
                self.phase = Phase.ANSWERING
                return "", ""
            if token == markers.start_id and not self._past_opening:
                self._past_opening = True
                return "", ""  # the model opened what the prompt had opened already (once)
            return self._reasoning(text), ""
        return self._think_by_text(text)

    def _open_by_text(self, text: str) -> tuple[str, str]:
        buffered = self._pending + text
        start = self.markers.start
        stripped = buffered.lstrip()
        if stripped.startswith(start):
            self._pending = ""
            self.phase, self.num_tokens, self._past_opening = Phase.THINKING, 1, True
            return self._think_by_text(stripped[len(start) :])
        if start.startswith(stripped):  # still possibly the opening (or only whitespace so far)
            self._pending = buffered
            return "", ""
        self._pending = ""
        self.phase = Phase.ANSWERING
        return "", buffered

    def _think_by_text(self, text: str) -> tuple[str, str]:
        buffered = self._pending + text
        self._pending = ""
        markers = self.markers
        if not self._past_opening:  # the model may open what the prompt had opened already
            stripped = buffered.lstrip()
            if stripped and len(stripped) < len(markers.start) and markers.start.startswith(stripped):
                self._pending = buffered
                return "", ""
            if stripped.startswith(markers.start):
                buffered = stripped[len(markers.start) :]
                self._past_opening = True
        at = buffered.find(markers.end)
        if at >= 0:
            self.phase = Phase.ANSWERING
            return self._reasoning(buffered[:at]), buffered[at + len(markers.end) :]
        keep = _partial_suffix(buffered, markers.end)
        self._pending = buffered[len(buffered) - keep :]
        return self._reasoning(buffered[: len(buffered) - keep]), ""

    def _reasoning(self, text: str) -> str:
        self._past_opening = self._past_opening or bool(text.strip())
        return text

    def flush(self) -> tuple[str, str]:
        """At the choice's end: held text goes where it was (a marker never completed is text)."""
        rest, self._pending = self._pending, ""
        if self.is_maybe:
            return "", rest
        return (rest, "") if self.is_thinking else ("", rest)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def initial_phase(prompt_text: str, markers: ReasoningMarkers, opens_by_default: bool) -> Phase:
    """Where a choice starts: thinking when the prompt ends by opening it (DeepSeek-R1's and Qwen3
    Thinking's templates), answering when it ends by closing it (Qwen3's `enable_thinking: false`),
    else thinking for a parser whose model always thinks (deepseek_r1) or undecided (qwen3)."""
    tail = prompt_text.rstrip()
    if tail.endswith(markers.start):
        return Phase.THINKING
    if tail.endswith(markers.end):
        return Phase.ANSWERING
    return Phase.THINKING if opens_by_default else Phase.MAYBE
