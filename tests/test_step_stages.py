"""The engine step's stages alone, on synthetic logits: sampling (draft verification, generator rewind,
forks, prompt logprobs) and the scheduler's update from its result. No model, no threads."""

import numpy as np
import pytest

from decoding.engine.detokenizer import IncrementalDetokenizer
from decoding.engine.outputs import FinishReason, RequestStream
from decoding.engine.params import SamplingParams
from decoding.engine.sampling import Sampler
from decoding.engine.scheduler import Scheduler
from decoding.engine.sequence import Request, Sequence, seed_generator
from decoding.engine.step import ChunkResult, SampledTokens, ScheduledChunk, ScheduledStep, StepResult
from decoding.engine.step_sampling import sample_step
from kvcache.manager import KVCacheManager

VOCAB = 32


def make_seq(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    request = Request("r", list(prompt), params, RequestStream("r"))
    seq = Sequence(request, 0, IncrementalDetokenizer(None), seed_generator(params.seed, 0))  # type: ignore[arg-type]
    seq.output_ids = list(output)
    request.sequences.append(seq)
    return seq


def peaked(tokens: list[int]) -> np.ndarray:
    """One logits row per token, each with that token far ahead of the rest."""
    logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)
    for row, token in enumerate(tokens):
        logits[row, token] = 30.0
    return logits


def test_a_decode_with_drafts_produces_the_agreeing_drafts_and_the_first_sample_that_disagrees():
    seq = make_seq(SamplingParams(temperature=0.0, max_tokens=50), [1, 2, 3], [4])
    chunk = ScheduledChunk(seq, 4, [4, 5, 6, 7], samples=True, num_draft_tokens=3)  # decode 4, drafts 5 6 7
    step = ScheduledStep([chunk])
    result = sample_step(step, peaked([5, 6, 9, 11]), [0], Sampler(VOCAB), guide=None)  # type: ignore[arg-type]
    [chunk_result] = result.chunks
    assert chunk_result.num_accepted_drafts == 2
    [sampled] = chunk_result.sampled
    assert sampled.seq is seq and sampled.token_ids == [5, 6, 9] and sampled.dead_ends == [False] * 3
    every_draft_agrees = sample_step(step, peaked([5, 6, 7, 11]), [0], Sampler(VOCAB), None)  # type: ignore[arg-type]
    assert every_draft_agrees.chunks[0].num_accepted_drafts == 3
    assert every_draft_agrees.chunks[0].sampled[0].token_ids == [5, 6, 7, 11]


@pytest.mark.parametrize("row_of_disagreement", [0, 1, 3])
def test_a_seeded_choice_draws_once_per_token_produced_whatever_the_drafts(row_of_disagreement):
    """Its generator is left as plain decoding leaves it: the draws of the rejected rows are taken back."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=50)
    seq = make_seq(params, [1, 2, 3], [4])
    drafts = [5, 6, 7]
    samples = [*drafts, 11]
    samples[row_of_disagreement] = 20
    step = ScheduledStep([ScheduledChunk(seq, 4, [4, *drafts], samples=True, num_draft_tokens=3)])
    result = sample_step(step, peaked(samples), [0], Sampler(VOCAB), None)  # type: ignore[arg-type]
    num_produced = row_of_disagreement + 1
    assert result.chunks[0].sampled[0].token_ids == samples[:num_produced]
    plain = seed_generator(1234, 0)
    plain.random(num_produced)
    assert seq.rng.random() == plain.random()


def test_a_prompt_that_ends_samples_every_forked_choice_from_its_last_row_each_with_its_own_generator():
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=5)
    seq = make_seq(params, [1, 2, 3])
    forks = [seq.fork(1), seq.fork(2)]
    step = ScheduledStep([ScheduledChunk(seq, 0, [1, 2, 3], samples=True, forks=forks)])
    logits = np.zeros((1, VOCAB), dtype=np.float32)  # uniform: each choice's draw decides
    result = sample_step(step, logits, [0], Sampler(VOCAB), None)  # type: ignore[arg-type]
    sampled = result.chunks[0].sampled
    assert [s.seq for s in sampled] == [seq, *forks]
    expected = [int(seed_generator(7, i).random() * VOCAB) for i in range(3)]  # inverse CDF of a uniform row
    assert [s.token_ids for s in sampled] == [[t] for t in expected]


def test_prompt_logprobs_are_those_of_the_prompt_tokens_each_row_predicts():
    params = SamplingParams(temperature=0.0, prompt_logprobs=1, max_tokens=5)
    seq = make_seq(params, [3, 8, 9, 10, 12])
    step = ScheduledStep([ScheduledChunk(seq, 2, [9, 10, 12], samples=True)])  # positions 2..4 of 5
    logits = np.log(np.full((3, VOCAB), 1.0 / VOCAB, dtype=np.float32))
    logits[0, 10] = np.log(0.5)
    result = sample_step(step, logits, [0], Sampler(VOCAB), None)  # type: ignore[arg-type]
    entries = result.chunks[0].prompt_logprobs
    assert [e.token_id for e in entries] == [10, 12]  # the last row predicts past the prompt: sampled instead
    assert entries[0].top[0][0] == 10
    assert entries[0].logprob == pytest.approx(np.log(0.5) - np.log(0.5 + (VOCAB - 1) / VOCAB), abs=1e-5)


def test_update_from_output_rolls_back_rejected_drafts_advances_forks_and_frees_the_finished():
    kv = KVCacheManager(64, 4, 256, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(SamplingParams(temperature=0.0, max_tokens=50, n=2), [1, 2, 3, 4, 5])
    scheduler.add(seq)
    step = scheduler.schedule()
    [chunk] = step.chunks
    assert chunk.samples and [f.index for f in chunk.forks] == [1]  # the prompt ends: choice 1 forks
    fork = chunk.forks[0]
    result = StepResult([ChunkResult([SampledTokens(seq, [7], [None], [False]),
                                      SampledTokens(fork, [8], [None], [False])])])
    for sampled in result.chunks[0].sampled:
        sampled.seq.output_ids.extend(sampled.token_ids)
    assert scheduler.update_from_output(step, result) == 5  # five prompt positions computed for the first time
    assert seq.num_computed_tokens == fork.num_computed_tokens == 5 and fork in scheduler.running
    # a decode with three drafts of which one is accepted: two positions' KV rolled back
    decode = ScheduledChunk(seq, 5, [7, 9, 9, 9], samples=True, num_draft_tokens=3)
    kv.append_slots(seq.seq_id, decode.token_ids)
    step = ScheduledStep([decode], num_decode_tokens=4, num_draft_tokens=3)
    result = StepResult([ChunkResult([SampledTokens(seq, [9, 4], [None, None], [False, False])],
                                     num_accepted_drafts=1)])
    seq.output_ids += [9, 4]
    assert kv.num_tokens(seq.seq_id) == 9
    scheduler.update_from_output(step, result)
    assert seq.num_computed_tokens == kv.num_tokens(seq.seq_id) == 7  # the decode token and the accepted draft
    seq.finish_reason = FinishReason.LENGTH  # as the output stage marks it
    scheduler.update_from_output(ScheduledStep(), StepResult([]), finished=[seq])
    assert seq not in scheduler.running and fork in scheduler.running
    with pytest.raises(KeyError):
        kv.num_tokens(seq.seq_id)  # its blocks are released (the fork keeps the ones it shares)
