"""The sampling stage: a step's logits in, the tokens each choice produced out.

The rows that sample are a chunk's last row (a prompt's end, a decode), once for the sequence and
once for each choice forked from it; and every row of a decode with drafts. Row j of such a decode
was computed after drafts[:j], so it is sampled as plain decoding would sample it had it produced
those drafts; the drafts agree with the samples up to the first that does not, and the tokens
produced are the samples up to and including that one. A seeded choice's generator is then rewound
to one draw per token produced, as plain decoding leaves it. Grammars mask their rows first; a row
whose grammar allows nothing is drawn from zeros and marked a dead end.

`sample_step` touches no engine state beyond the choices' generators and grammar states (made at
their first sampled row): the scheduler and the output processor apply its result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import Sampler, SampleRequest, TokenLogprobs, log_softmax, top_logprobs
from .sequence import Sequence
from .step import ChunkResult, SampledTokens, ScheduledChunk, ScheduledStep, StepResult
from .structured import GrammarState, Guide, apply_masks


@dataclass(slots=True)
class _Draw:
    """One choice's rows in the step: `first` (an index among the sampled rows) and one per draft."""

    result: ChunkResult
    seq: Sequence
    first: int
    drafts: list[int]


def sample_step(step: ScheduledStep, logits: np.ndarray, first_rows: list[int], sampler: Sampler,
                guide: Guide) -> StepResult:  # fmt: skip
    """`logits`: the step's logits rows; `first_rows`: each chunk's first row among them (-1: none)."""
    rows: list[int] = []
    requests: list[SampleRequest] = []
    draws: list[_Draw] = []
    results: list[ChunkResult] = []
    for chunk, first_row in zip(step.chunks, first_rows, strict=True):
        seq, result = chunk.seq, ChunkResult()
        results.append(result)
        wants_prompt_logprobs = seq.params.prompt_logprobs is not None and not seq.output_ids
        if wants_prompt_logprobs and first_row >= 0:
            result.prompt_logprobs = prompt_token_logprobs(chunk, logits[first_row : first_row + chunk.num_tokens])
        if chunk.num_draft_tokens:
            drafts = chunk.drafts
            draws.append(_Draw(result, seq, len(rows), drafts))
            for j in range(len(drafts) + 1):
                rows.append(first_row + j)
                requests.append(SampleRequest(seq.params, seq.rng, seq.prompt_ids, seq.output_ids + drafts[:j]))
        elif chunk.samples:
            last_row = first_row + (chunk.num_tokens - 1 if wants_prompt_logprobs else 0)
            for choice in (seq, *chunk.forks):
                draws.append(_Draw(result, choice, len(rows), []))
                rows.append(last_row)
                requests.append(SampleRequest(choice.params, choice.rng, choice.prompt_ids, choice.output_ids))
    if not rows:
        return StepResult(results)
    # the masks change the rows they draw from: the step's own rows where each is drawn once and in order (no
    # copy of 18 MiB at 32 streams of a 152k vocabulary; the step reads them no more), else a copy
    rows_logits = logits[: len(rows)] if rows == list(range(len(rows))) else logits[rows]
    constrained = [(d.first, grammar, d.drafts) for d in draws if (grammar := _grammar(d.seq, guide)) is not None]
    dead = set(apply_masks(rows_logits, constrained, guide))
    rows_logits[list(dead)] = 0.0  # drawn, then dropped: the sampler needs finite rows
    rng_states = [d.seq.rng.bit_generator.state if d.drafts and not d.seq.params.is_greedy else None for d in draws]
    tokens, logprobs = sampler.sample(rows_logits, requests)
    token_list = tokens.tolist()
    for draw, rng_state in zip(draws, rng_states, strict=True):
        num_produced = 1
        if draw.drafts:
            samples = token_list[draw.first : draw.first + len(draw.drafts)]
            num_accepted = next((j for j, draft in enumerate(draw.drafts) if samples[j] != draft), len(draw.drafts))
            if rng_state is not None:
                draw.seq.rng.bit_generator.state = rng_state
                draw.seq.rng.random(num_accepted + 1)
            draw.result.num_accepted_drafts = num_accepted
            num_produced = num_accepted + 1
        span = range(draw.first, draw.first + num_produced)
        draw.result.sampled.append(SampledTokens(draw.seq, [token_list[i] for i in span], [logprobs[i] for i in span],
                                                 [i in dead for i in span]))  # fmt: skip
    return StepResult(results)


def _grammar(seq: Sequence, guide: Guide) -> GrammarState | None:
    """What the choice's next token is held to, made when first needed: its constraint's grammar (a tool
    call's from its opening on, made by the output stage); for a thinking model, nothing while it thinks,
    the end marker once its budget is spent, and the constraint only once the thinking is over."""
    if seq.grammar is not None:
        return seq.grammar
    reasoning, constraint = seq.reasoning, seq.params.constraint
    if reasoning is not None and reasoning.budget_spent(seq.detokenizer.is_mid_character):
        seq.grammar = GrammarState.start(guide, reasoning.markers.end_constraint(), is_json=False,
                                         ends_reasoning=True)  # fmt: skip
    elif constraint is None or (reasoning is not None and reasoning.is_thinking):
        return None
    elif reasoning is not None and reasoning.is_maybe:  # the model may open its thinking instead of answering
        seq.grammar = GrammarState.start(guide, constraint, also_allowed=reasoning.markers.start_id)
    else:
        seq.grammar = GrammarState.start(guide, constraint)
    return seq.grammar


def prompt_token_logprobs(chunk: ScheduledChunk, logits: np.ndarray) -> list[TokenLogprobs]:
    """Row i of a prompt chunk predicts the token after it: each such prompt token's logprob given its prefix."""
    prompt = chunk.seq.prompt_ids
    logprobs = log_softmax(logits)
    k = chunk.seq.params.prompt_logprobs or 0
    entries = []
    for i in range(chunk.num_tokens):
        position = chunk.position + i + 1
        if position < len(prompt):
            token = prompt[position]
            entries.append(TokenLogprobs(token, float(logprobs[i, token]), top_logprobs(logprobs[i], k)))
    return entries
