"""Embeddings inside the generation engine's steps (`--task generate,embed`): pooled as transformers pools
the tiny Qwen3's hidden states (tests/golden/embeddings/decoder-qwen3.json), inputs split over steps like
prompts, the streams beside them unchanged and never held back, cancellation, failures and blocks freed."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from decoding import load_model
from decoding.engine.embedding import InputTooLong
from decoding.engine.engine import Engine, EngineConfig, EngineFailed, EngineShuttingDown
from decoding.engine.params import SamplingParams
from decoding.engine.step import ScheduledStep
from decoding.model.decoder_embedder import decoder_embedder

QWEN3 = Path(__file__).parent / "golden" / "architectures" / "qwen3"
GOLDEN = json.loads((Path(__file__).parent / "golden" / "embeddings" / "decoder-qwen3.json").read_text("utf-8"))
INPUTS = [(x["ids"], [0] * len(x["ids"])) for x in GOLDEN["inputs"]]  # 1 to 80 tokens
PROMPT = list(range(5, 25))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def shared_engine(pooling: str = "mean", kernels: str = "exact", **config: object) -> tuple[Engine, object]:
    model = load_model(QWEN3)
    settings = {"max_num_batched_tokens": 32, "max_num_seqs": 8, **config}
    engine = Engine(model, EngineConfig(kernels=kernels, **settings))  # type: ignore[arg-type]
    embeddings = engine.serve_embeddings(decoder_embedder(model, pooling, True, 4096))
    return engine.start(), embeddings


class StepLog:
    def __init__(self) -> None:
        self.steps: list[tuple[list[int], int, int]] = []  # seq ids of the chunks, embedding tokens, all tokens

    def on_step_scheduled(self, scheduled: ScheduledStep, seconds: float, kernel_seconds: float) -> None:
        self.steps.append(([c.seq.seq_id for c in scheduled.chunks], scheduled.num_embedding_tokens,
                           scheduled.num_tokens + scheduled.num_embedding_tokens))  # fmt: skip


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("kernels, atol", [("exact", 2e-5), ("fast", 5e-3)])
def test_embeddings_beside_a_stream_equal_transformers_and_leave_the_stream_as_it_was(pooling, kernels, atol):
    alone = Engine(load_model(QWEN3), EngineConfig(kernels=kernels, max_num_batched_tokens=32, max_num_seqs=8))
    try:
        expected_tokens = alone.start().generate(PROMPT, greedy(30))[0].token_ids
    finally:
        alone.shutdown()
    engine, embeddings = shared_engine(pooling, kernels)
    log = StepLog()
    engine.observers.append(log)
    try:
        stream = engine.submit(PROMPT, greedy(30))
        first = next(iter(stream))  # decoding: the inputs land beside its decode steps
        got = embeddings.encode(INPUTS)
        tokens = first.token_ids + [t for output in stream for t in output.token_ids]
        assert engine.num_unfinished == 0 and engine.num_kv_blocks_used == 0
    finally:
        engine.shutdown()
    np.testing.assert_allclose(got, np.array(GOLDEN[pooling], dtype=np.float32), atol=atol)
    assert tokens == expected_tokens  # the kernels are batch-invariant: sharing steps changes nothing
    shared = [step for step in log.steps if step[1] and step[0]]
    assert shared, "the inputs never shared a step with the stream"
    assert max(total for _, _, total in log.steps) <= 32
    assert sum(1 for _, tokens_, _ in log.steps if tokens_) >= 3  # the 80-token input took several steps


def test_a_large_embedding_request_never_holds_a_stream_back_nor_a_small_request_behind_it():
    engine, embeddings = shared_engine("last", max_num_batched_tokens=64)
    log = StepLog()
    engine.observers.append(log)
    many = [(ids, types) for ids, types in INPUTS[:3]] * 60  # 180 inputs, 1,140 tokens
    try:
        stream = engine.submit(PROMPT, greedy(60))
        first = next(iter(stream))
        stream_seq = engine.scheduler.running[0].seq_id
        large = embeddings.submit(many)
        small = embeddings.submit(INPUTS[1:2])
        small.result(timeout=60)
        assert not large.done()  # its inputs were spread over the steps the small one shared
        assert len(first.token_ids + [t for output in stream for t in output.token_ids]) == 60
        large.result(timeout=120)
    finally:
        engine.shutdown()
    last_decode = max(i for i, (seqs, _, _) in enumerate(log.steps) if stream_seq in seqs)
    while_streaming = [step for step in log.steps[:last_decode] if step[1]]
    assert len(while_streaming) >= 10 and all(stream_seq in seqs for seqs, _, _ in while_streaming)  # every step
    assert max(total for _, _, total in log.steps) <= 64


def test_a_cancelled_request_frees_its_inputs_blocks_and_its_place_in_the_queue():
    engine, embeddings = shared_engine("mean", max_num_batched_tokens=16)
    started = threading.Event()

    class FirstStep:
        def on_step_scheduled(self, scheduled: ScheduledStep, seconds: float, kernel_seconds: float) -> None:
            started.set()

    engine.observers.append(FirstStep())
    try:
        large = embeddings.submit(INPUTS * 40)
        assert started.wait(60)
        large.cancel()
        later = embeddings.encode(INPUTS[:2])  # served after the cancelled request left
        np.testing.assert_allclose(later, np.array(GOLDEN["mean"][:2], dtype=np.float32), atol=2e-5)
        assert engine.num_unfinished == 0 and engine.num_kv_blocks_used == 0
        assert not engine.scheduler.embedding_lane.in_progress
    finally:
        engine.shutdown()


def test_a_failed_step_ends_its_embedding_requests_and_the_engine_serves_on():
    engine, embeddings = shared_engine("last")

    def poison(scheduled: ScheduledStep) -> None:
        if scheduled.embeddings:
            engine.fault_hook = None
            raise RuntimeError("injected fault")

    engine.fault_hook = poison
    try:
        failed = embeddings.submit(INPUTS)
        with pytest.raises(EngineFailed, match="RuntimeError"):
            failed.result(timeout=60)
        got = embeddings.encode(INPUTS)
        np.testing.assert_allclose(got, np.array(GOLDEN["last"], dtype=np.float32), atol=2e-5)
        assert engine.generate(PROMPT, greedy(5))[0].finish_reason == "length"
        assert engine.num_unfinished == 0 and engine.num_kv_blocks_used == 0
    finally:
        engine.shutdown()


def test_last_token_pooling_starts_from_a_cached_prefix_and_gets_the_same_vector():
    engine, embeddings = shared_engine("last", enable_prefix_caching=True, block_size=16)
    long_input = INPUTS[3]  # 80 tokens: five full blocks
    try:
        first = embeddings.encode([long_input])
        hits_before = engine.kv.stats.num_hit_tokens
        again = embeddings.encode([long_input])
        assert engine.kv.stats.num_hit_tokens - hits_before == 64  # all but the block holding the last token
    finally:
        engine.shutdown()
    assert np.array_equal(first, again)


def test_inputs_that_could_never_run_are_refused_and_a_stopped_engine_refuses_all():
    engine, embeddings = shared_engine("mean", max_model_len=64)
    try:
        with pytest.raises(InputTooLong, match="input 1 has 80 tokens") as refused:
            embeddings.submit([INPUTS[0], INPUTS[3]])
        assert refused.value.index == 1
        with pytest.raises(ValueError, match="outside the vocabulary"):
            embeddings.submit([([10**7], [0])])
        assert embeddings.encode([]).shape == (0, 64)
    finally:
        engine.shutdown()
    with pytest.raises(EngineShuttingDown):
        embeddings.submit(INPUTS[:1])
