"""The scheduler alone: budgets, chunking, first come first served, preemption. No model, no threads."""

import time

import numpy as np

from decoding.engine.detokenizer import IncrementalDetokenizer
from decoding.engine.outputs import RequestStream
from decoding.engine.params import SamplingParams
from decoding.engine.scheduler import Scheduler
from decoding.engine.sequence import Request, Sequence, SequenceStatus
from decoding.engine.step import ChunkResult, SampledTokens, ScheduledStep, StepResult
from decoding.engine.step_costs import LONG_PREFILL_TOKENS
from kvcache.manager import KVCacheManager


def make_seq(prompt_len: int, name: str = "r") -> Sequence:
    request = Request(name, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=64), RequestStream(name))
    seq = Sequence(request, 0, detokenizer=IncrementalDetokenizer(None), rng=np.random.default_rng(0))
    request.sequences.append(seq)
    return seq


def finish_step(scheduler: Scheduler, step: ScheduledStep, next_token: int = 7) -> None:
    """The stages after the model step, every sampled row drawing `next_token`: the output stage appends
    it, then the scheduler updates from the result."""
    result = StepResult([ChunkResult([SampledTokens(seq, [next_token], [None], [False])
                                      for seq in ((chunk.seq, *chunk.forks) if chunk.samples else ())])
                         for chunk in step.chunks])
    for chunk_result in result.chunks:
        for sampled in chunk_result.sampled:
            sampled.seq.output_ids.extend(sampled.token_ids)
    scheduler.update_from_output(step, result)


def test_decodes_come_first_then_prefill_chunks_within_the_budget():
    scheduler = Scheduler(KVCacheManager(64, 4, 512, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=10)
    a, b = make_seq(6, "a"), make_seq(30, "b")
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert [(c.seq, c.num_tokens, c.samples) for c in out.chunks] == [(a, 6, True), (b, 4, False)]
    finish_step(scheduler, out)
    for _ in range(3):
        out = scheduler.schedule()
        assert out.chunks[0].seq is a and out.chunks[0].num_tokens == 1  # a's decode is never starved
        assert out.num_tokens <= 10
        finish_step(scheduler, out)
    assert b.num_computed_tokens == 30 and b.output_ids == [7]  # b's prompt arrived in chunks: 4, 9, 9, 8


def test_admission_is_first_come_first_served_and_bounded_by_max_num_seqs():
    scheduler = Scheduler(KVCacheManager(64, 4, 512, enable_prefix_caching=False), max_num_seqs=2,
                          max_num_batched_tokens=64)
    seqs = [make_seq(3, f"r{i}") for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    out = scheduler.schedule()
    assert [c.seq for c in out.chunks] == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:]
    finish_step(scheduler, out)
    scheduler.remove(seqs[0])
    out = scheduler.schedule()
    assert [c.seq for c in out.chunks] == [seqs[1], seqs[2]]


def test_a_large_head_of_queue_is_not_overtaken():
    scheduler = Scheduler(KVCacheManager(8, 4, 512, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=64)
    running = make_seq(20, "running")  # 5 of 8 blocks
    scheduler.add(running)
    finish_step(scheduler, scheduler.schedule())
    big, small = make_seq(16, "big"), make_seq(2, "small")
    scheduler.add(big)
    scheduler.add(small)
    out = scheduler.schedule()
    assert [c.seq for c in out.chunks] == [running]  # small would fit, but big came first
    scheduler.remove(running)
    out = scheduler.schedule()
    assert [c.seq for c in out.chunks] == [big, small]


def test_out_of_blocks_preempts_the_newest_and_it_is_recomputed_later():
    kv = KVCacheManager(6, 4, 512, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq(12, "old"), make_seq(8, "new")  # 3 + 2 blocks of 6
    scheduler.add(old)
    scheduler.add(new)
    finish_step(scheduler, scheduler.schedule())
    # old's first decode token starts a 4th block; new's a 3rd: 7 > 6 blocks
    out = scheduler.schedule()
    assert out.preempted == [new] and new.status == SequenceStatus.WAITING
    assert [c.seq for c in out.chunks] == [old]
    assert new.num_computed_tokens == 0 and new.output_ids == [7]  # its token is kept, its KV recomputed
    assert scheduler.num_preemptions == 1
    scheduler.remove(old)
    out = scheduler.schedule()
    assert [(c.seq, c.num_tokens, c.samples) for c in out.chunks] == [(new, 9, True)]  # prompt + its token


def test_a_sequence_nobody_reads_is_preempted_first_and_not_readmitted_until_its_reader_returns():
    kv = KVCacheManager(5, 4, 512, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    gone, live = make_seq(8, "gone"), make_seq(12, "live")  # 2 + 3 blocks of 5; gone is the older
    scheduler.add(gone)
    scheduler.add(live)
    finish_step(scheduler, scheduler.schedule())
    gone.request.stream.set_unattended(True)  # its connection closed; a reconnect may come
    out = scheduler.schedule()  # live's decode needs a 6th block
    assert out.preempted == [gone] and [c.seq for c in out.chunks] == [live]
    finish_step(scheduler, out)
    scheduler.remove(live)  # every block free again, and still gone is not admitted
    assert scheduler.schedule().chunks == [] and list(scheduler.waiting) == [gone]
    gone.request.stream.set_unattended(False)
    assert [(c.seq, c.num_tokens) for c in scheduler.schedule().chunks] == [(gone, 9)]


def test_a_lone_sequence_that_cannot_grow_preempts_itself_and_nothing_is_lost():
    kv = KVCacheManager(3, 4, 512, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(4, "a"), make_seq(8, "b")
    scheduler.add(a)
    scheduler.add(b)
    finish_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # a needs a 4th block: b (newest) goes
    assert out.preempted == [b]
    assert kv.num_used_blocks == 2
    scheduler.remove(a)
    assert kv.num_used_blocks == 0


def test_removing_sequences_returns_every_block():
    kv = KVCacheManager(32, 4, 512)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16)
    seqs = [make_seq(n, f"r{n}") for n in (3, 9, 21)]
    for s in seqs:
        scheduler.add(s)
    for _ in range(4):
        finish_step(scheduler, scheduler.schedule())
    for s in seqs:
        scheduler.remove(s)
    assert kv.num_used_blocks == 0 and not scheduler.has_work


def test_prefill_chunks_while_decoding_are_sized_to_keep_the_step_within_the_stretch():
    from decoding.engine.step_costs import StepCostModel

    model = StepCostModel(max_itl_stretch=2.0)
    assert model.prefill_budget_while_decoding(256, 16) == 64  # not measured yet: a modest chunk
    for _ in range(20):
        model.observe(num_decode_tokens=16, num_prefill_tokens=0, seconds=0.020)
        model.observe(num_decode_tokens=16, num_prefill_tokens=40, seconds=0.060)  # 1 ms per extra token
    # 20 ms more at 1 ms a token would double the step; chunks are planned to 80% of that allowance
    assert model.prefill_budget_while_decoding(256, 16) == 16
    assert StepCostModel(max_itl_stretch=3.0).prefill_budget_while_decoding(8, 1) == 8  # never above the budget


def test_the_decode_step_is_priced_at_the_batch_size_and_keeps_its_slope_while_the_batch_is_steady():
    from decoding.engine.step_costs import StepCostModel

    model = StepCostModel(max_itl_stretch=2.0)
    for i in range(40):  # a churning batch: 10-40 rows, 0.5 ms each over 5 ms
        rows = 10 + (7 * i) % 31
        model.observe(num_decode_tokens=rows, num_prefill_tokens=0, seconds=0.005 + 0.0005 * rows)
    assert abs(model.seconds_per_row - 0.0005) < 1e-9 and abs(model.decode_step_seconds(32) - 0.021) < 1e-9
    assert abs(model.decode_step_seconds(10) - 0.010) < 1e-9
    for _ in range(200):  # then a steady batch: no spread to refit from, the slope stays
        model.observe(num_decode_tokens=32, num_prefill_tokens=0, seconds=0.021)
    assert abs(model.seconds_per_row - 0.0005) < 1e-9


def test_a_wave_of_prompts_teaches_the_price_of_its_decode_rows_from_the_steps_it_shares():
    """A wave's steps all carry a prefill: the decode rows must be priced from them, not from the last
    decode-only steps (a one-row warm-up), or the wave's chunks shrink to a fifth of what the bound allows
    (its last prompts then waited 2.5 s for a first token instead of ~1.4)."""
    from decoding.engine.step_costs import StepCostModel

    def truth(rows: int, tokens: int) -> float:
        return 0.005 + 0.0012 * rows + 0.0006 * tokens

    model = StepCostModel(max_itl_stretch=2.0)
    for _ in range(2):  # warm-up requests: a prompt alone, then one-row decodes
        model.observe(0, 51, truth(0, 51))
        for _ in range(3):
            model.observe(1, 0, truth(1, 0))
    # the wave: full-budget steps (rows + prompt tokens = 256), then prompts beside the decodes
    for rows, tokens in [(0, 51), (1, 255), (8, 248), (11, 245), (16, 240), (22, 40), (23, 44), (24, 38), (25, 47),
                         (26, 41), (27, 39), (28, 45)]:
        model.observe(rows, tokens, truth(rows, tokens))
    assert abs(model.decode_step_seconds(28) - truth(28, 0)) < 0.1 * truth(28, 0)
    allowed = 0.8 * truth(28, 0) / 0.0006  # 80% of one more decode step's time, in prompt tokens
    assert abs(model.prefill_budget_while_decoding(256, 28) - allowed) <= 0.1 * allowed


def test_costs_fitted_from_collinear_steps_stay_positive_and_whole():
    """Full-budget steps have rows + prompt tokens = the budget: a fit of them alone can give a slope
    below zero, and a base taken from that fit beside an older slope priced a step at seconds."""
    from decoding.engine.step_costs import StepCostModel

    model = StepCostModel(max_itl_stretch=2.0)
    rng = np.random.default_rng(3)
    for _ in range(60):
        rows = int(rng.integers(0, 40))
        model.observe(rows, 256 - rows, 0.15 * (1 + 0.2 * rng.standard_normal()))  # noise, no trend
        assert model.seconds_per_token > 0 and (model.seconds_per_row or 1.0) > 0
        assert 0 < model.decode_step_seconds(32) < 1.0


def test_a_long_prompt_arriving_during_decodes_gets_the_time_budgeted_chunk():
    scheduler = Scheduler(KVCacheManager(256, 4, 2048, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=256)
    streams = [make_seq(4, f"s{i}") for i in range(3)]
    for s in streams:
        scheduler.add(s)
    finish_step(scheduler, scheduler.schedule())
    for _ in range(5):  # decode-only steps of 10 ms; an extra token costs 1 ms
        out = scheduler.schedule()
        scheduler.observe_step(out, 0.010)
        finish_step(scheduler, out)
    scheduler.step_costs.seconds_per_token = 0.001
    long_prompt = make_seq(800, "long")  # more than LONG_PREFILL_TOKENS: held to the time budget
    scheduler.add(long_prompt)
    out = scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [1, 1, 1, 8]  # 80% of the 10 ms a 2x step allows


def test_a_long_prompt_stays_throttled_to_its_last_chunk():
    """Its last chunks attend over the whole prompt: the dearest tokens of all, even with few left."""
    scheduler = Scheduler(KVCacheManager(256, 4, 2048, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=256)
    stream = make_seq(4, "stream")
    scheduler.add(stream)
    finish_step(scheduler, scheduler.schedule())
    scheduler.step_costs.assume(0.010, 1, 1e-6)  # cheap for now: whole-budget chunks
    long_prompt = make_seq(800, "long")
    scheduler.add(long_prompt)
    for _ in range(3):
        finish_step(scheduler, scheduler.schedule())
    assert 0 < long_prompt.num_uncomputed_tokens < LONG_PREFILL_TOKENS
    scheduler.step_costs.seconds_per_token = scheduler.step_costs.latest_seconds_per_token = 0.001
    out = scheduler.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(stream, 1), (long_prompt, 8)]


def decoding_scheduler(decode_step_seconds: float, seconds_per_token: float,
                       num_streams: int = 1) -> tuple[Scheduler, Sequence]:
    """A scheduler whose `num_streams` streams decode (the first is returned), at the cost given."""
    scheduler = Scheduler(KVCacheManager(512, 4, 2048, enable_prefix_caching=False), max_num_seqs=16,
                          max_num_batched_tokens=256)
    streams = [make_seq(4, f"stream{i}") for i in range(num_streams)]
    for stream in streams:
        scheduler.add(stream)
    finish_step(scheduler, scheduler.schedule())
    stream = streams[0]
    scheduler.step_costs.assume(decode_step_seconds, num_streams, seconds_per_token)
    return scheduler, stream


def test_short_prompts_arriving_during_decodes_are_held_to_the_step_time_bound_too():
    """A wave of short prompts prefilled beside many decodes is what stretched the inter-token tail
    (treadle bench churn: steps a prefill shared were 20% of the steps and held the p99)."""
    scheduler, _ = decoding_scheduler(0.050, 0.001, num_streams=10)  # a 2x step allows 50 ms: 40 tokens planned
    short = make_seq(300, "short")
    scheduler.add(short)
    out = scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [1] * 10 + [44]  # one awaiting in ten: 1.1x the extra time


def test_at_a_few_streams_short_prompts_still_get_the_floor_and_long_ones_the_bound():
    """A short decode step would allow only a few prompt tokens a step, and a queue would drain slower
    than requests arrive: short prompts may always take PREFILL_FLOOR_SECONDS of a step."""
    from decoding.engine.step_costs import PREFILL_FLOOR_SECONDS

    scheduler, _ = decoding_scheduler(0.010, 0.001, num_streams=9)  # the bound: 8 tokens
    floor_tokens = round(PREFILL_FLOOR_SECONDS / 0.001)
    assert floor_tokens > 8
    long_prompt = make_seq(800, "long")  # arrives first
    short = make_seq(300, "short")
    scheduler.add(long_prompt)
    scheduler.add(short)
    out = scheduler.schedule()
    assert [(c.seq.request.request_id, c.num_tokens) for c in out.chunks][-2:] == [
        ("long", 8), ("short", floor_tokens - 8)]


def make_request_seq(prompt_len: int, n: int, name: str) -> Sequence:
    request = Request(name, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=64, n=n),
                      RequestStream(name))
    seq = Sequence(request, 0, detokenizer=IncrementalDetokenizer(None), rng=np.random.default_rng(0))
    request.sequences.append(seq)
    return seq


def test_admission_counts_every_choice_a_request_will_fork_against_max_num_seqs():
    scheduler = Scheduler(KVCacheManager(256, 4, 512, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=64)
    wide = [make_request_seq(3, 4, f"wide{i}") for i in range(3)]
    for s in wide:
        scheduler.add(s)
    out = scheduler.schedule()
    # two requests of 4 choices fill 8 slots although only two sequences run before they fork
    assert [c.seq for c in out.chunks] == wide[:2] and list(scheduler.waiting) == wide[2:]
    assert scheduler.num_reserved_seqs == 8


def test_decodes_beyond_the_token_budget_preempt_the_newest():
    scheduler = Scheduler(KVCacheManager(256, 4, 512, enable_prefix_caching=False), max_num_seqs=6,
                          max_num_batched_tokens=6)
    seqs = [make_seq(2, f"r{i}") for i in range(6)]
    for s in seqs:
        scheduler.add(s)
    for _ in range(10):
        if all(s.output_ids for s in seqs):
            break
        finish_step(scheduler, scheduler.schedule())
    assert all(s.output_ids for s in seqs)
    # A seventh running sequence (as a fork adds one) must not push the step past its token budget.
    extra = make_seq(2, "extra")
    scheduler.kv.fork(seqs[0].seq_id, extra.seq_id)
    extra.num_computed_tokens, extra.output_ids = seqs[0].num_computed_tokens, list(seqs[0].output_ids)
    scheduler.add_running(extra)
    out = scheduler.schedule()
    assert out.num_tokens == 6 and {c.seq for c in out.chunks} == set(seqs)
    assert out.preempted == [extra] and list(scheduler.waiting) == [extra]
    assert extra.status == SequenceStatus.WAITING and extra.num_computed_tokens == 0


def make_prioritised(prompt_len: int, name: str, priority: int, arrival: float) -> Sequence:
    seq = make_seq(prompt_len, name)
    seq.request.priority = priority
    seq.request.arrival_time = arrival
    return seq


def test_admission_goes_by_priority_then_arrival():
    scheduler = Scheduler(KVCacheManager(64, 4, 512, enable_prefix_caching=False), max_num_seqs=1,
                          max_num_batched_tokens=64)
    now = time.monotonic()
    low_early = make_prioritised(3, "low-early", 5, now - 3)
    low_late = make_prioritised(3, "low-late", 5, now - 2)
    high = make_prioritised(3, "high", -1, now - 1)
    default = make_prioritised(3, "default", 0, now)
    for seq in (low_early, low_late, high, default):
        scheduler.add(seq)
    admitted = []
    while scheduler.has_work:
        out = scheduler.schedule()
        (chunk,) = out.chunks
        admitted.append(chunk.seq.request.request_id)
        finish_step(scheduler, out)
        scheduler.remove(chunk.seq)
    assert admitted == ["high", "default", "low-early", "low-late"]


def test_a_starved_low_priority_request_goes_ahead_of_higher_ones():
    scheduler = Scheduler(KVCacheManager(64, 4, 512, enable_prefix_caching=False), max_num_seqs=1,
                          max_num_batched_tokens=64, priority_starvation_seconds=10.0)
    now = time.monotonic()
    starved = make_prioritised(3, "starved", 100, now - 11)
    fresh_high = make_prioritised(3, "fresh-high", -100, now)
    waiting_high = make_prioritised(3, "waiting-high", -100, now - 5)
    for seq in (fresh_high, waiting_high, starved):
        scheduler.add(seq)
    assert scheduler.next_waiting(now) is starved
    scheduler.priority_starvation_seconds = None  # without the bound it would wait behind both
    assert scheduler.next_waiting(now) is waiting_high


def test_preemption_takes_the_lowest_priority_first():
    # 4 blocks of 4 tokens: three one-block prompts decode until the cache runs out
    scheduler = Scheduler(KVCacheManager(4, 4, 512, enable_prefix_caching=False), max_num_seqs=3,
                          max_num_batched_tokens=64)
    now = time.monotonic()
    high_late = make_prioritised(3, "high-late", 0, now - 1)
    low_early = make_prioritised(3, "low-early", 1, now - 3)
    mid = make_prioritised(3, "mid", 0, now - 2)
    for seq in (low_early, mid, high_late):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert {c.seq for c in out.chunks} == {low_early, mid, high_late}
    preempted = []
    for _ in range(8):
        finish_step(scheduler, out)
        out = scheduler.schedule()
        preempted += out.preempted
        if preempted:
            break
    # the newest is not the victim: the lowest priority is, though it arrived first
    assert preempted[0] is low_early


def test_a_wave_of_prompts_that_outnumbers_the_streams_fills_the_step():
    """A burst (as many prompts awaiting their first token as streams decoding) is prefilled at once;
    fewer awaiting earn the short ones more of a step in proportion."""
    scheduler, _ = decoding_scheduler(0.040, 0.001, num_streams=4)  # the bound: 32 tokens
    wave = [make_seq(60, f"w{i}") for i in range(4)]
    for seq in wave:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [1] * 4 + [60] * 4
    scheduler, _ = decoding_scheduler(0.040, 0.001, num_streams=4)
    scheduler.add(make_seq(300, "one"))  # one of four: 1.25x the bound's extra time, 40 tokens
    assert [c.num_tokens for c in scheduler.schedule().chunks] == [1] * 4 + [40]


def test_a_burst_split_by_the_token_budget_is_prefilled_whole_and_later_arrivals_wait_their_turn():
    """A wave larger than one step's budget: its first prompts start decoding and outnumber the rest,
    which stay a burst (held to the bound, they came a chunk a step and waited seconds more); a prompt
    arriving after the burst began is held to the bound as usual."""
    scheduler, _ = decoding_scheduler(0.040, 0.002, num_streams=4)  # the bound at 8 decodes: 40 tokens
    wave = [make_seq(60, f"w{i}") for i in range(6)]  # 6 awaiting >= 4 decoding: a burst
    for seq in wave:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [1] * 4 + [60] * 4 + [12]  # 252 tokens: the budget
    finish_step(scheduler, out)
    late = make_seq(60, "late")
    scheduler.add(late)
    out = scheduler.schedule()  # 8 decoding, 3 awaiting: the burst's two go on whole, the late one waits
    assert [(c.seq.request.request_id, c.num_tokens) for c in out.chunks] == [
        *[(s.request.request_id, 1) for s in scheduler.running[:8]], ("w4", 48), ("w5", 60)]
    finish_step(scheduler, out)
    out = scheduler.schedule()  # the burst is done: the late prompt gets the bound (with its queue's share)
    assert [c.num_tokens for c in out.chunks][-1] < 60
