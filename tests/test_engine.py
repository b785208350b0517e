"""The engine end to end on the default model: stops, choices, aborts, limits, faults, logprobs."""

import threading
import time

import numpy as np
import pytest

from decoding.engine.engine import Engine, EngineConfig, EngineFailed, QueueFull, RequestTooLarge
from decoding.engine.params import InvalidParams, SamplingParams
from decoding.engine.sampling import log_softmax
from decoding.kernels.reference import forward_logits
from threadpool import BrokenPool

from .conftest import GOLDEN

CAPITAL = "The capital of France is"


@pytest.fixture(scope="module")
def engine(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=16, max_num_batched_tokens=128, kv_cache_mb=96,
                                             kernels="exact")).start()
    yield eng
    eng.shutdown()


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **extra)


def test_greedy_tokens_match_transformers(engine, default_model):
    for name in ("capital", "digits", "chat"):
        golden = np.load(GOLDEN / f"logits_{name}.npz")
        out = engine.generate(golden["ids"].tolist(), greedy(12, ignore_eos=True))[0]
        expected, margins = golden["greedy_ids"][:12].tolist(), golden["greedy_margin"][:12]
        for step, (got, want, margin) in enumerate(zip(out.token_ids, expected, margins, strict=False)):
            if margin > 1e-3:
                assert got == want, f"{name}: step {step}"
            if got != want:
                break  # past a near-tie the continuations may legitimately part


def test_fast_kernels_agree_with_transformers_on_clear_greedy_steps(default_model):
    eng = Engine(default_model, EngineConfig(kv_cache_mb=32, kernels="fast")).start()
    try:
        golden = np.load(GOLDEN / "logits_digits.npz")
        out = eng.generate(golden["ids"].tolist(), greedy(12, ignore_eos=True))[0]
        expected, margins = golden["greedy_ids"][:12].tolist(), golden["greedy_margin"][:12]
        for got, want, margin in zip(out.token_ids, expected, margins, strict=False):
            if got != want:
                assert margin < 0.5, "int8 activations may only flip near-ties"
                break
    finally:
        eng.shutdown()


def test_stop_string_is_not_emitted_and_nothing_past_it_leaks(engine, default_model):
    ids = default_model.tokenizer.encode(CAPITAL)
    full = engine.generate(ids, greedy(16))[0].text
    assert full.startswith(" Paris.\n\nThe answer is")
    deltas = [o for o in engine.submit(ids, greedy(16, stop=("answer is", "zzz")))]
    assert "".join(d.text for d in deltas) == " Paris.\n\nThe "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "answer is"


def test_stop_string_spanning_tokens_is_held_back_until_decided(engine, default_model):
    ids = default_model.tokenizer.encode(CAPITAL)
    # "answer" is a prefix of the stop string but the stop never completes: the text must still arrive
    out = engine.generate(ids, greedy(16, stop=("answer was",)))[0]
    full = engine.generate(ids, greedy(16))[0]
    assert out.text == full.text and out.finish_reason == "length"


def test_stop_token_ids_end_the_choice_without_their_text(engine, default_model):
    tok = default_model.tokenizer
    period = tok.encode(".")[0]
    out = engine.generate(tok.encode(CAPITAL), greedy(16, stop_token_ids=(period,)))[0]
    assert out.text == " Paris" and out.finish_reason == "stop" and out.stop_reason == period


def test_max_tokens_ends_with_length_and_usage_counts_tokens(engine, default_model):
    ids = default_model.tokenizer.encode(CAPITAL)
    out = engine.generate(ids, greedy(5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 5)


def test_eos_stops_unless_ignored(engine, default_model):
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say just the word yes."}]))
    stopped = engine.generate(ids, greedy(64))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] in default_model.config.eos_token_ids
    assert "<|im_end|>" not in stopped.text
    ignored = engine.generate(ids, greedy(len(stopped.token_ids) + 5, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(stopped.token_ids) + 5


def test_n_choices_fork_from_one_prompt_and_choice_0_matches_n_1(engine, default_model):
    ids = default_model.tokenizer.encode("Once upon a time")
    params = dict(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    choices = engine.generate(ids, SamplingParams(n=3, **params))
    single = engine.generate(ids, SamplingParams(n=1, **params))[0]
    assert [c.index for c in choices] == [0, 1, 2]
    assert choices[0].token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in choices}) == 3
    usage = next(c.usage for c in choices if c.usage is not None)
    assert usage.completion_tokens == 30 and usage.prompt_tokens == len(ids)
    assert engine.num_kv_blocks_used == 0


def test_abort_ends_the_request_and_frees_its_blocks(engine, default_model):
    ids = default_model.tokenizer.encode("Tell me a long story about a weaver.")
    stream = engine.submit(ids, SamplingParams(max_tokens=2000, ignore_eos=True), request_id="to-abort")
    outputs = []
    for out in stream:
        outputs.append(out)
        if len(outputs) == 3:
            engine.abort("to-abort")
    assert outputs[-1].finish_reason == "abort_client"
    deadline = time.monotonic() + 5
    while engine.num_kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_kv_blocks_used == 0 and engine.num_unfinished == 0


def test_requests_that_can_never_fit_are_refused_up_front(default_model):
    eng = Engine(default_model, EngineConfig(max_model_len=64, num_kv_blocks=8, block_size=4, n_threads=1))
    try:
        with pytest.raises(RequestTooLarge, match="context"):
            eng.submit(list(range(10, 70)), SamplingParams(max_tokens=10))
        with pytest.raises(RequestTooLarge):
            eng.submit(list(range(10, 40)), SamplingParams(max_tokens=10))  # 40 tokens > 8 blocks of 4
        with pytest.raises(InvalidParams):
            eng.submit([], SamplingParams())
        with pytest.raises(InvalidParams):
            eng.submit([10, 10**6], SamplingParams())
    finally:
        eng.shutdown()


def test_a_full_queue_refuses_new_requests(default_model):
    eng = Engine(default_model, EngineConfig(max_queue=2, kv_cache_mb=32))  # not started: nothing drains
    try:
        eng.submit([10, 11], SamplingParams())
        eng.submit([10, 11], SamplingParams())
        with pytest.raises(QueueFull):
            eng.submit([10, 11], SamplingParams())
    finally:
        eng.shutdown()


def test_a_failing_step_ends_exactly_the_requests_it_held_and_the_engine_keeps_serving(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=64, kernels="exact")).start()
    try:
        ids = default_model.tokenizer.encode(CAPITAL)
        in_failed_step: set[str] = set()

        def poison(scheduled):
            if any(c.seq.request.request_id == "poisoned" for c in scheduled.chunks):
                in_failed_step.update(c.seq.request.request_id for c in scheduled.chunks)
                raise RuntimeError("injected fault")

        eng.fault_hook = poison
        # "early" decodes alone until "poisoned" arrives: both are in the step that fails; "late"
        # arrives after it and never meets the fault.
        early = eng.submit(ids, greedy(40, ignore_eos=True), request_id="early")
        next(iter(early))
        failed = eng.generate(ids + [13], greedy(5), request_id="poisoned")
        late = eng.generate(ids, greedy(4), request_id="late")[0]
        eng.fault_hook = None
        assert failed[0].finish_reason == "error" and "RuntimeError" in failed[0].error
        assert in_failed_step == {"early", "poisoned"}  # a failure cannot be pinned on one of them
        assert list(early)[-1].finish_reason == "error"
        assert late.finish_reason == "length" and late.text == " Paris.\n\n"
        assert eng.num_kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_logprobs_and_prompt_logprobs_match_the_reference(default_model):
    eng = Engine(default_model, EngineConfig(kv_cache_mb=32, block_size=2, kernels="exact")).start()
    try:
        ids = default_model.tokenizer.encode(CAPITAL)
        eng.generate(ids, greedy(1))  # puts the prompt's blocks in the prefix cache
        out = eng.generate(ids, greedy(3, logprobs=2, prompt_logprobs=1))[0]
        reference = log_softmax(forward_logits(default_model, ids + out.token_ids[:-1]))
        for step, lp in enumerate(out.logprobs):
            row = reference[len(ids) - 1 + step]
            assert lp.token_id == out.token_ids[step]
            assert lp.logprob == pytest.approx(row[lp.token_id], abs=2e-3)
            assert [t for t, _ in lp.top] == np.argsort(-row)[:2].tolist()
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == ids[position]
            assert lp.logprob == pytest.approx(reference[position - 1, ids[position]], abs=2e-3)
    finally:
        eng.shutdown()


def test_an_idle_engine_parks_and_burns_no_cpu(engine):
    engine.generate([10, 11, 12], greedy(2))
    time.sleep(0.2)
    before = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - before < 0.2  # a spinning thread would use ~1 s of CPU here
    assert any(t.name == "treadle-engine" for t in threading.enumerate())


def run_until_done(eng: Engine, streams) -> None:
    """Turn a stopped engine's loop by hand (deterministic: no thread decides when a step runs)."""
    for _ in range(10_000):
        if all(s.is_finished for s in streams):
            return
        eng.step()
    raise AssertionError("the requests did not finish")


def merged(stream) -> list:
    outputs = {}
    for out in stream:
        if out.index in outputs:
            outputs[out.index].merge(out)
        else:
            outputs[out.index] = out
    return [outputs[i] for i in sorted(outputs)]


@pytest.mark.parametrize("prompt_logprobs", [1, None], ids=["echo-logprobs", "plain"])
def test_a_prompt_preempted_mid_prefill_answers_as_if_it_never_was(default_model, prompt_logprobs):
    # 17 blocks of 16: two decoders with 70-token prompts hold 10 (10 tokens of room each), the
    # 100-token prompt takes the other 7 and prefills 6 tokens a step, so the decoders' first new
    # blocks must preempt it mid-prefill; it is recomputed once they are done.
    # speculation off: drafts would change how fast each sequence grows, and so whether this one is preempted
    config = EngineConfig(num_kv_blocks=17, max_num_seqs=3, max_num_batched_tokens=8, kernels="exact", n_threads=1,
                          speculative="off")
    prompt = [int(t) for t in np.random.default_rng(3).integers(1000, 30000, 100)]
    params = greedy(1, logprobs=1, prompt_logprobs=prompt_logprobs)
    eng = Engine(default_model, config)  # never started: this test turns the loop itself
    try:
        decoders = [eng.submit(list(range(2000 + 100 * i, 2070 + 100 * i)), greedy(30, ignore_eos=True))
                    for i in range(2)]
        while not all(s.output_ids for s in eng.scheduler.running):
            eng.step()
        contended = eng.submit(prompt, params, request_id="contended")
        eng.step()
        seq = eng.outputs.requests["contended"].sequences[0]
        run_until_done(eng, [*decoders, contended])
        assert seq.num_preemptions > 0 and eng.scheduler.num_preemptions > 0
        alone = eng.submit(prompt, params)
        run_until_done(eng, [alone])
        got, want = merged(contended)[0], merged(alone)[0]
        assert got.token_ids == want.token_ids
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(prompt), 1)
        if prompt_logprobs:
            assert len(got.prompt_logprobs) == len(prompt) == len(want.prompt_logprobs)
            assert got.prompt_logprobs == want.prompt_logprobs
        assert got.usage.cached_tokens == 0  # nothing of it was cached when it arrived
        # prompt tokens count once per request, however often a preemption made them run again
        assert eng.stats.num_prompt_tokens == 2 * 70 + 2 * len(prompt) - want.usage.cached_tokens
    finally:
        eng.shutdown()


class _Fatal(BaseException):
    """Not an Exception: what the engine loop cannot contain (as a KeyboardInterrupt would be)."""


def fail_once(exc: BaseException, real):
    def failing(*args, **kwargs):
        failing.calls += 1
        if failing.calls == 1:
            raise exc
        return real(*args, **kwargs)

    failing.calls = 0
    return failing


def test_an_error_in_the_scheduler_fails_what_it_held_and_the_engine_serves_on(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=32, kernels="exact", n_threads=1))
    ids = default_model.tokenizer.encode(CAPITAL)
    try:
        held = [eng.submit(ids + [13] * i, greedy(20, ignore_eos=True)) for i in range(2)]
        eng.step()  # both admitted and prefilled: their blocks hold computed KV
        eng.scheduler.schedule = fail_once(RuntimeError("injected scheduler fault"), eng.scheduler.schedule)
        eng.start()
        for stream in held:
            last = list(stream)[-1]
            assert last.finish_reason == "error" and "RuntimeError" in last.error
        after = eng.generate(ids, greedy(4))[0]
        assert after.finish_reason == "length" and after.text == " Paris.\n\n"
        assert eng.num_kv_blocks_used == 0 and eng.num_unfinished == 0 and not eng.is_failed
    finally:
        eng.shutdown()


def test_an_error_applying_one_request_from_the_inbox_fails_only_that_request(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=32, kernels="exact", n_threads=1))
    ids = default_model.tokenizer.encode(CAPITAL)
    real_add = eng.scheduler.add

    def add(seq):
        if seq.request.request_id == "broken":
            raise RuntimeError("injected inbox fault")
        real_add(seq)

    eng.scheduler.add = add
    try:
        broken = eng.submit(ids, greedy(4), request_id="broken")
        healthy = eng.submit(ids, greedy(4), request_id="healthy")
        eng.start()
        assert [o.finish_reason for o in broken] == ["error"]
        assert "".join(o.text for o in healthy) == " Paris.\n\n"
        assert eng.num_unfinished == 0 and eng.num_kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_a_request_that_fails_before_it_is_registered_ends_alone(default_model):
    """Its stream gets an error; the requests already running are not forgotten with it."""
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=32, kernels="exact", n_threads=1))
    ids = default_model.tokenizer.encode(CAPITAL)
    real_add = eng.outputs.add

    def add(request):
        if request.request_id == "broken":
            raise RuntimeError("injected registration fault")
        return real_add(request)

    eng.outputs.add = add
    try:
        healthy = eng.submit(ids, greedy(4), request_id="healthy")
        eng.step()  # registered, prefilled and decoding
        broken = eng.submit(ids, greedy(4), request_id="broken")
        eng.start()
        assert [o.finish_reason for o in broken] == ["error"]
        outputs: list = []
        reader = threading.Thread(target=lambda: outputs.extend(healthy), daemon=True)
        reader.start()
        reader.join(60)  # forgotten by the engine, it would never end
        assert outputs and outputs[-1].finish_reason == "length"
        assert "".join(o.text for o in outputs) == " Paris.\n\n"
        assert eng.num_unfinished == 0 and eng.num_kv_blocks_used == 0
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death, expected
def test_when_the_engine_thread_dies_every_stream_ends_and_new_requests_are_refused(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=32, kernels="exact", n_threads=1))
    ids = default_model.tokenizer.encode(CAPITAL)
    try:
        running = eng.submit(ids, greedy(20, ignore_eos=True))
        eng.step()
        eng.scheduler.schedule = fail_once(_Fatal("injected"), eng.scheduler.schedule)
        eng.start()
        last = list(running)[-1]
        assert last.finish_reason == "error" and "_Fatal" in last.error
        eng._thread.join(10)
        assert eng.is_failed and "_Fatal" in eng.failure
        with pytest.raises(EngineFailed):
            eng.submit(ids, greedy(4))
        assert eng.num_unfinished == 0
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, expected
def test_a_broken_pool_ends_the_engine_instead_of_failing_every_later_step(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=32, kernels="exact", n_threads=1))
    ids = default_model.tokenizer.encode(CAPITAL)
    try:
        def broken(batch):
            raise BrokenPool("a worker died")

        eng.runner.forward = broken
        eng.start()
        assert list(eng.submit(ids, greedy(4)))[-1].finish_reason == "error"
        eng._thread.join(10)
        assert eng.is_failed and "BrokenPool" in eng.failure
    finally:
        eng.shutdown()


def test_a_request_that_waits_past_its_queue_timeout_ends_unstarted_and_is_counted(default_model):
    timeouts = []

    class CountTimeouts:
        def __getattr__(self, name):
            return lambda *args: timeouts.append(name) if name == "on_queue_timeout" else None

    eng = Engine(default_model, EngineConfig(max_num_seqs=1, kv_cache_mb=16)).start()
    eng.observers.append(CountTimeouts())
    try:
        ids = default_model.tokenizer.encode(CAPITAL)
        busy = eng.submit(ids, greedy(400, ignore_eos=True))
        first = next(iter(busy))  # the only slot is taken
        assert first.token_ids
        in_time = eng.submit(ids, greedy(2), queue_timeout=600)
        late = eng.generate(ids, greedy(4), queue_timeout=0.2)
        assert [(o.finish_reason, o.token_ids) for o in late] == [("timeout", [])]
        assert "queue" in late[0].error and timeouts == ["on_queue_timeout"]
        eng.abort(busy.request_id)
        # one that was admitted in time is served in full, whatever its timeout
        assert sum(len(o.token_ids) for o in in_time) == 2
    finally:
        eng.shutdown()
    with pytest.raises(InvalidParams):
        eng.submit([1, 2], greedy(1), queue_timeout=0)
