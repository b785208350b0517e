"""The n-gram drafter and the draft cost model behind speculative decoding (decoding/engine/speculative.py)."""

from __future__ import annotations

import random

from decoding.engine.speculative import MARGIN, DraftCostModel, NgramDrafter


def brute_force_proposal(tokens: list[int], max_n: int, num: int) -> list[int]:
    """The longest n-gram ending `tokens` that occurred earlier, its latest earlier occurrence's continuation."""
    for n in range(min(max_n, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num]
    return []


def test_proposals_match_a_rescan_of_the_whole_context():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
        drafter = NgramDrafter(tokens[:5], max_n=3, max_draft_tokens=8)
        drafter.num_tokens_to_draft = 8
        for token in tokens[5:]:
            drafter.append(token)
            assert drafter.propose(8) == brute_force_proposal(drafter.tokens, 3, 8), (trial, drafter.tokens)
            drafter.num_tokens_to_draft = 8  # the shadow drafts adapt it; fixed here to compare


def test_a_repeated_passage_is_proposed_whole_and_the_draft_grows_while_accepted():
    passage = list(range(100, 140))
    drafter = NgramDrafter([1, 2, *passage, 3, 4, *passage[:3]])
    assert drafter.propose(8) == passage[3:5]  # starts short
    drafter.record(2, 2)
    assert drafter.propose(8) == passage[3:7]
    drafter.record(4, 4)
    assert drafter.propose(8) == passage[3:11] and drafter.propose(3) == passage[3:6]
    drafter.record(8, 1)  # mostly refused: back to what was accepted, plus one
    assert drafter.num_tokens_to_draft == 2 and drafter.acceptance < 0.7
    assert NgramDrafter([5, 6, 7]).propose(8) == []  # nothing repeats


def test_drafts_not_run_still_teach_the_acceptance():
    drafter = NgramDrafter([1, 2, 3, 4, 1, 2])
    before = drafter.acceptance
    drafter.shadow(8)  # would propose [3, 4]
    drafter.append(3)
    drafter.append(4)
    assert drafter.acceptance > before and drafter.num_tokens_to_draft == 4 and drafter.num_drafted == 0
    drafter.shadow(8)  # after "... 1 2 3 4": proposes what followed "3 4" earlier: [1, 2]
    drafter.append(9)
    assert drafter.num_tokens_to_draft == 1


def test_the_step_model_measures_each_batch_size_range_on_its_own():
    model = DraftCostModel()
    assert model.acceptance_needed(1) is None  # unmeasured: a few drafts run, and measure
    rng = random.Random(1)
    for _ in range(200):  # one stream: a 3 ms step bound by reading the weights, 0.1 ms a token
        tokens = 1 + rng.choice([0, 0, 2, 8])
        model.observe(1, tokens, 0.003 + 0.0001 * tokens + rng.uniform(-1e-5, 1e-5))
    assert model.acceptance_needed(1) < 0.05 + MARGIN
    assert model.acceptance_needed(32) is None  # 32 streams are another regime, not measured yet
    for _ in range(200):  # 32 streams, compute-bound: 0.9 ms a token on a 1 ms base
        tokens = 32 + rng.choice([0, 0, 8])
        model.observe(32, tokens, 0.001 + 0.0009 * tokens)
    assert model.acceptance_needed(32) == 1.0 and model.acceptance_needed(40) == 1.0
    assert model.acceptance_needed(1) < 0.05 + MARGIN  # one stream's estimate is not disturbed
    for _ in range(300):  # nobody drafts for a while: the base follows, the draft cost is remembered
        model.observe(1, 1, 0.004 + 0.0001)
    assert 0.0 < model.acceptance_needed(1) < 0.05 + MARGIN
    for _ in range(DraftCostModel.REMEASURE_AFTER_STEPS):  # ... until it is old: drafts measure it again
        model.observe(1, 1, 0.004 + 0.0001)
    assert model.acceptance_needed(1) is None


def test_one_noisy_step_with_drafts_does_not_stop_drafting():
    model = DraftCostModel()
    for _ in range(20):
        model.observe(4, 4, 0.04)
    model.observe(4, 12, 0.12)  # the first step with drafts, on a busy host: three times too long
    assert model.acceptance_needed(4) is None  # not trusted yet: drafts go on and measure
    for _ in range(DraftCostModel.MIN_DRAFTED_STEPS):
        model.observe(4, 12, 0.05)
    assert model.acceptance_needed(4) < 0.5


def test_the_bench_unique_workload_gives_every_request_a_prompt_never_seen_before(default_model):
    """`treadle bench engine --speculative`'s `unique` workload stands for a server's traffic: no two
    requests share a prompt, in one run or across runs, so none is served from the prefix cache."""
    from bench.speculative import _REQUEST_NUMBERS, workloads

    unique = next(w for w in workloads() if w.name == "unique")
    first = unique.prompts(default_model, [next(_REQUEST_NUMBERS) for _ in range(8)])
    second = unique.prompts(default_model, [next(_REQUEST_NUMBERS) for _ in range(8)])
    assert len({tuple(p) for p in first + second}) == 16
    assert all(30 <= len(p) <= 120 for p in first)  # short questions, as the traffic was
    shared = next(w for w in workloads() if w.name == "chat")
    assert len({tuple(p) for p in shared.prompts(default_model, [0, 1, 2])}) == 1
