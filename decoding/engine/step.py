"""What one engine step hands from stage to stage: the scheduler's plan, and what sampling made of it.

    ScheduledStep  (Scheduler.schedule)  →  logits (ModelRunner.forward)
        →  StepResult (sample_step)  →  outputs published (OutputProcessor.process)
        →  Scheduler.update_from_output
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.manager import BlockCopy

from .embedding_lane import EmbeddingChunk
from .sampling import TokenLogprobs
from .sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    position: int  # of its first token: the sequence's num_computed_tokens when it was scheduled
    token_ids: list[int]  # the tokens whose KV this step computes, from `position` on
    samples: bool  # the chunk reaches the sequence's end: its last row's logits pick the next token
    num_draft_tokens: int = 0  # a decode's speculative tail: every row is sampled, to verify them
    # the request's other choices (n > 1), forked from this chunk's sequence as its prompt ends: they
    # share its blocks and draw their first token from the same row
    forks: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def drafts(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


@dataclass(slots=True)
class ScheduledStep:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_decode_tokens: int = 0  # decodes and their draft tokens
    num_draft_tokens: int = 0
    embeddings: list[EmbeddingChunk] = field(default_factory=list)  # after the chunks' rows in the batch

    @property
    def num_tokens(self) -> int:
        """The generation's tokens (the chunks')."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_embedding_tokens(self) -> int:
        return sum(c.num_tokens for c in self.embeddings)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.embeddings


@dataclass(slots=True)
class SampledTokens:
    """The tokens one choice produced this step, in order (more than one where drafts were accepted)."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    dead_ends: list[bool]  # per token: its grammar allowed no token at that row, so the choice cannot go on


@dataclass(slots=True)
class ChunkResult:
    sampled: list[SampledTokens] = field(default_factory=list)  # the chunk's sequence, then its forks
    num_accepted_drafts: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # of each prompt token a row of the chunk predicts


@dataclass(slots=True)
class StepResult:
    chunks: list[ChunkResult]  # one per scheduled chunk, in the same order
