"""Requests (what a client asked for) and sequences (their tokens in the engine)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from .detokenizer import IncrementalDetokenizer
from .outputs import FinishReason, RequestStream
from .params import SamplingParams
from .reasoning import ReasoningTracker
from .sampling import TokenLogprobs
from .speculative import NgramDrafter
from .structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    priority: int = 0  # lower first (vLLM's convention); see Scheduler for how long a low one can wait
    queue_deadline: float | None = None  # time.monotonic() past which it is not admitted any more (a 503)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at its first admission
    num_prompt_tokens_computed: int = 0  # leading prompt positions computed at least once (recomputes aside)
    num_finished_choices: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def is_finished(self) -> bool:
        return self.num_finished_choices == self.params.n

    @property
    def was_admitted(self) -> bool:
        """Its first sequence has been scheduled at least once (it may be waiting again, preempted)."""
        first = self.sequences[0] if self.sequences else None
        return first is not None and (first.status != SequenceStatus.WAITING or first.num_preemptions > 0)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.sequences)

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(s.reasoning.num_tokens for s in self.sequences if s.reasoning is not None)

    @property
    def draft_token_counts(self) -> tuple[int, int]:
        """Speculative draft tokens verified for its choices, and how many of them were accepted."""
        drafters = [s.drafter for s in self.sequences if s.drafter is not None]
        return sum(d.num_drafted for d in drafters), sum(d.num_accepted for d in drafters)


def seed_generator(seed: int | None, index: int) -> np.random.Generator:
    """Choice `index` of a request: choice 0 of seed s draws what a single-choice request with seed s draws."""
    if seed is None:
        return np.random.default_rng()
    seed &= 2**64 - 1
    return np.random.default_rng(seed if index == 0 else [seed, index])


@dataclass(eq=False, slots=True)
class Sequence:
    request: Request
    index: int  # choice index within the request
    detokenizer: IncrementalDetokenizer
    rng: np.random.Generator
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens its current prefill had to compute when admitted (cache hits aside)
    status: SequenceStatus = SequenceStatus.WAITING
    held_text: str = ""  # decoded text not yet sent: it could be the start of a stop string
    sent_text_tail: str = ""  # the last characters sent, where a stop string may have begun
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    grammar: GrammarState | None = None  # structured output (or a tool call under way): made at its first draw
    drafter: NgramDrafter | None = None  # speculative decoding: its n-gram index, made at its first decode
    reasoning: ReasoningTracker | None = None  # a thinking model's choice: where its thinking stands

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def fork(self, index: int) -> Sequence:
        """Choice `index` of the same request, as this one stands before its first output token (its
        blocks are shared by the caller)."""
        assert not self.output_ids, "choices fork when their prompt is done, before any output"
        return Sequence(self.request, index, self.detokenizer.copy(), seed_generator(self.params.seed, index),
                        num_computed_tokens=self.num_computed_tokens, status=self.status,
                        reasoning=self.reasoning.copy() if self.reasoning is not None else None)

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def token_ids(self, begin: int, end: int) -> list[int]:
        prompt = self.request.prompt_ids
        n = len(prompt)
        if end <= n:
            return prompt[begin:end]
        if begin >= n:
            return self.output_ids[begin - n : end - n]
        return prompt[begin:] + self.output_ids[: end - n]

    def all_token_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_paused(self) -> bool:
        """Its reader has not taken the output so far (past the unread limit), or it has no reader (the
        connection closed, a reconnect may come): produce no more for now."""
        stream = self.request.stream
        return stream.is_unattended or stream.is_backlogged

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= len(self.request.prompt_ids)


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string occurrence in `text` that ends at or after `search_from`: (start, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, search_from - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best


def partial_stop_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: text to hold back."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
