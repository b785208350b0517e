"""The engine end to end on the default model: stops, choices, aborts, limits, faults, logprobs."""

import threading
import time

import numpy as np
import pytest

from decoding.engine import Engine, EngineConfig, QueueFull, RequestTooLarge
from decoding.params import InvalidParams, SamplingParams
from decoding.reference import forward_logits
from decoding.sampling import log_softmax

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
        for step, (got, want, margin) in enumerate(zip(out.token_ids, expected, margins)):
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
        for got, want, margin in zip(out.token_ids, expected, margins):
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
    assert outputs[-1].finish_reason == "abort"
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


def test_a_failing_step_ends_only_its_requests_and_the_engine_keeps_serving(default_model):
    eng = Engine(default_model, EngineConfig(max_num_seqs=4, kv_cache_mb=64, kernels="exact")).start()
    try:
        ids = default_model.tokenizer.encode(CAPITAL)
        survivor = eng.submit(ids, greedy(40, ignore_eos=True), request_id="survivor")
        first = next(iter(survivor))  # the survivor is decoding before the poisoned request arrives

        def poison(scheduled):
            if any(c.seq.request.request_id == "poisoned" for c in scheduled.chunks):
                raise RuntimeError("injected fault")

        eng.fault_hook = poison
        failed = eng.generate(ids + [13], greedy(5), request_id="poisoned")
        eng.fault_hook = None
        assert failed[0].finish_reason == "error" and "RuntimeError" in failed[0].error
        rest = [o for o in survivor]
        assert first.text and rest[-1].finish_reason in ("error", "length")
        after = eng.generate(ids, greedy(4))[0]
        assert after.finish_reason == "length" and after.text == " Paris.\n\n"
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
