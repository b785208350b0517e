"""A request's tokens depend only on model, prompt, parameters and seed — never on the batch.

The same seeded, temperature > 0 request runs alone; among 31 concurrent requests of other lengths
and parameters; with a token budget small enough to chunk its prompt; under KV pressure that preempts
it; and on one pool thread instead of two. Every run must give the identical tokens, on SmolLM2 and on
a tiny model of every architecture.
"""

import threading

import numpy as np
import pytest

from decoding import load_model
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from tests.test_architectures import ARCHITECTURES, GOLDEN

TARGET_TEXT = ("In a small village by the river, an old weaver kept a loom that had belonged to her grandmother. "
               "Every morning she")
NEIGHBOUR_TEXT = "The quick brown fox jumps over the lazy dog while the weaver counts threads and sings. " * 6


def target_params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


def neighbours(tokenizer, count: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(99)
    corpus = tokenizer.encode(NEIGHBOUR_TEXT)
    out = []
    for i in range(count):
        start = int(rng.integers(0, len(corpus) - 40))
        length = int(rng.integers(3, 40))
        max_tokens = int(rng.integers(2, 16))
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=max_tokens, temperature=1.2, top_k=40),  # unseeded
            SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, repetition_penalty=1.2),
        ][i % 3]
        out.append((corpus[start : start + length], params))
    return out


def run(model, config: EngineConfig, target_ids, params, others=(), record_preempted=None):
    """The target's tokens; the neighbours are submitted first, all at once, so they share its steps."""
    engine = Engine(model, config).start()
    try:
        if record_preempted is not None:
            engine.fault_hook = lambda s: record_preempted.update(q.request.request_id for q in s.preempted)
        streams = [engine.submit(ids, p) for ids, p in others]
        target = engine.submit(target_ids, params, request_id="target")
        tokens = [t for out in target for t in out.token_ids]
        threads = [threading.Thread(target=lambda s=s: [o for o in s]) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.num_kv_blocks_used == 0
        return tokens
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=["smollm2", *ARCHITECTURES])
def setup(request, default_model):
    """SmolLM2, then a tiny model of each architecture (sliding windows, head norms, biases...)."""
    model = default_model if request.param == "smollm2" else load_model(GOLDEN / request.param)
    tok = model.tokenizer
    return model, tok.encode(TARGET_TEXT), neighbours(tok, 31)


def skip_int8_where_heads_are_narrow(model, kv: str) -> None:
    if kv == "int8" and model.config.head_dim % 32:
        pytest.skip(f"an int8 KV cache needs heads of a multiple of 32 values; "
                    f"this model's have {model.config.head_dim}")


@pytest.mark.parametrize(("kernels", "kv"), [("fast", "auto"), ("exact", "auto"), ("fast", "int8"), ("exact", "int8")])
def test_seeded_sampling_is_identical_alone_crowded_chunked_and_single_threaded(setup, kernels, kv):
    model, target_ids, others = setup
    skip_int8_where_heads_are_narrow(model, kv)
    params = target_params(seed=7)
    base = EngineConfig(max_num_seqs=32, max_num_batched_tokens=256, kv_cache_mb=128, kernels=kernels,
                        kv_cache_dtype=kv)  # fmt: skip
    alone = run(model, base, target_ids, params)
    assert len(alone) == 12

    assert run(model, base, target_ids, params, others) == alone  # among 31 others

    chunked = EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, kv_cache_mb=128, kernels=kernels,
                           kv_cache_dtype=kv)  # fmt: skip
    assert len(target_ids) > 16
    assert run(model, chunked, target_ids, params, others[:6]) == alone  # its prompt spans several steps

    one_thread = EngineConfig(max_num_seqs=32, max_num_batched_tokens=256, kv_cache_mb=128, n_threads=1,
                              kernels=kernels, kv_cache_dtype=kv)  # fmt: skip
    assert run(model, one_thread, target_ids, params, others[:6]) == alone


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_seeded_sampling_is_identical_when_preempted_and_recomputed(setup, kv):
    model, target_ids, _ = setup
    skip_int8_where_heads_are_narrow(model, kv)
    target_ids = target_ids[:25]  # 4 blocks of 8, whatever the tokenizer (the cache below is sized for it)
    params = target_params(seed=2024)
    # Same block size as below: attention's online softmax works block by block, so the block size is
    # part of the engine's configuration, like the kernel mode; batch, preemption and threads are not.
    alone = run(model, EngineConfig(kv_cache_mb=64, block_size=8, kv_cache_dtype=kv), target_ids, params)
    # Two greedy neighbours with 64-token prompts (8 full blocks each) are admitted before the target
    # (4 blocks); their first decode tokens need two more blocks than the 21 there are, so the
    # target, the newest, is preempted, recomputed when room returns, and must continue identically.
    long_prompt = model.tokenizer.encode(NEIGHBOUR_TEXT)[:64]
    hogs = [(long_prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)),
            (long_prompt[::-1], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))]
    preempted: set[str] = set()
    tight = EngineConfig(max_num_seqs=8, max_num_batched_tokens=160, num_kv_blocks=21, block_size=8,
                         enable_prefix_caching=False, speculative="off",  # drafts would change who is preempted
                         kv_cache_dtype=kv)  # fmt: skip
    assert run(model, tight, target_ids, params, hogs, record_preempted=preempted) == alone
    assert "target" in preempted, "the cache was meant to be too small to keep the target running"


def test_greedy_output_does_not_change_with_the_number_of_parallel_requests(setup):
    model, target_ids, others = setup
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = EngineConfig(max_num_seqs=32, max_num_batched_tokens=256, kv_cache_mb=128)
    assert run(model, base, target_ids, params) == run(model, base, target_ids, params, others)
