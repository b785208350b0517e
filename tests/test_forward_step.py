"""The model step on the pool against the numpy reference, for mixed batches."""

import numpy as np
import pytest

from decoding import load_model
from decoding.engine.runner import ModelRunner, StepBatch
from decoding.kernels.forward import StepScratch, tile_mode
from decoding.kernels.phases import PHASES
from decoding.kernels.reference import forward_logits
from decoding.model.quant import QType
from kvcache.batch import build_batch_arrays
from kvcache.manager import KVCacheManager
from kvcache.storage import KVCacheSpec, KVCacheStorage
from tests.tinymodel import TinyShape, write_gguf
from threadpool import SpinPool

BLOCK_SIZE = 8


class StepDriver:
    """Drives the runner by hand: sequences, their tokens, and which of them compute what each step."""

    def __init__(self, model, n_threads: int, num_blocks: int = 128, kernels: str = "exact",
                 feed_forward_rows: int | None = None):  # fmt: skip
        cfg = model.config
        spec = KVCacheSpec(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           block_size=BLOCK_SIZE)
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, cfg.max_context, enable_prefix_caching=False)
        self.pool = SpinPool(n_threads)
        self.runner = ModelRunner(model, KVCacheStorage.allocate(spec, num_blocks), self.pool, 128, 128, kernels)
        if feed_forward_rows is not None:
            self.runner.state = StepScratch.allocate(cfg, 128, 128, n_threads, BLOCK_SIZE, tile_mode(kernels),
                                                     feed_forward_rows)  # fmt: skip
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def add(self, seq_id: int, token_ids: list[int]) -> None:
        self.tokens[seq_id] = list(token_ids)
        self.computed[seq_id] = self.kv.allocate(seq_id, token_ids)

    def step(self, work: dict[int, int]) -> dict[int, np.ndarray]:
        """Compute `work[seq_id]` more tokens of each sequence; logits of every computed row."""
        seq_ids = list(work)
        chunks = []
        for seq_id, n in work.items():
            begin = self.computed[seq_id]
            chunk = self.tokens[seq_id][begin : begin + n]
            assert len(chunk) == n
            self.kv.append_slots(seq_id, chunk)
            chunks.append(chunk)
            self.computed[seq_id] += n
        arrays = build_batch_arrays(self.kv, seq_ids, [len(c) for c in chunks])
        token_ids = np.asarray([t for c in chunks for t in c], dtype=np.int32)
        logits = self.runner.forward(StepBatch(token_ids, arrays, np.arange(token_ids.size, dtype=np.int32)))
        out, row = {}, 0
        for seq_id, chunk in zip(seq_ids, chunks, strict=True):
            out[seq_id] = logits[row : row + len(chunk)].copy()
            row += len(chunk)
        return out

    def close(self) -> None:
        self.pool.close()


def check_mixed_batches(model, n_threads: int, atol: float, kernels: str = "exact") -> dict[int, np.ndarray]:
    """Drive five mixed steps; compare every computed row with the reference. Returns the rows."""
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size
    prompts = {1: 30, 2: 50, 3: 7, 4: 17}
    full = {s: rng.integers(3, vocab, n + 4).tolist() for s, n in prompts.items()}
    driver = StepDriver(model, n_threads, kernels=kernels)
    try:
        for s in (1, 2):
            driver.add(s, full[s])
        got = {s: [] for s in prompts}

        def run(work):
            for s, rows in driver.step(work).items():
                got[s].append(rows)

        run({1: 30, 2: 20})  # a whole prompt beside the first chunk of another
        driver.add(3, full[3])
        run({1: 1, 2: 25, 3: 7})  # a decode, a middle chunk, a fresh prompt
        driver.add(4, full[4])
        run({2: 5, 1: 1, 3: 1, 4: 9})  # the last chunk, two decodes, a first chunk
        run({1: 1, 2: 1, 3: 1, 4: 8})
        run({4: 1, 3: 1, 2: 1, 1: 1})
        results = {}
        for s in prompts:
            rows = np.concatenate(got[s])
            reference = forward_logits(model, full[s][: rows.shape[0]])
            if kernels == "exact":
                np.testing.assert_allclose(rows, reference, atol=atol, rtol=0, err_msg=f"sequence {s}")
            else:  # int8 activations: llama.cpp-like error. Rounding is discontinuous, so one flip in an
                # early layer can move a whole row: bound the typical row, not the worst entry.
                row_errors = np.abs(rows - reference).max(axis=1)
                assert np.median(row_errors) <= atol * np.abs(reference).max(), f"sequence {s}"
                agree = np.mean(rows.argmax(axis=1) == reference.argmax(axis=1))
                assert agree >= 0.75, f"sequence {s}: top-1 agrees on {agree:.0%} of rows"
            results[s] = rows
        return results
    finally:
        driver.close()


K_TYPES = [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K]


def tiny_model(tmp_path_factory, qtype):
    if qtype in K_TYPES:  # rows of whole 256-weight super-blocks
        shape = TinyShape(n_layers=2, dim=256, hidden_dim=512, n_heads=4, n_kv_heads=2)
    else:
        shape = TinyShape(n_layers=2, dim=64, hidden_dim=96, n_heads=4, n_kv_heads=2)
    path = write_gguf(tmp_path_factory.mktemp("m") / f"{qtype.name}.gguf", shape, qtype=qtype, seed=int(qtype),
                      embedding_qtype=QType.Q8_0 if qtype == QType.Q4_1 else None)
    return load_model(path)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q8_0,
                                   QType.Q5_0, QType.Q5_1, *K_TYPES], ids=lambda q: q.name)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_exact_kernels_mixed_batch_logits_equal_the_reference(tmp_path_factory, qtype, n_threads):
    check_mixed_batches(tiny_model(tmp_path_factory, qtype), n_threads, atol=1e-4)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16, QType.Q5_0, QType.Q5_1, QType.Q4_K,
                                   QType.Q5_K, QType.Q6_K], ids=lambda q: q.name)
def test_fast_kernels_stay_close_to_the_reference_and_thread_invariant(tmp_path_factory, qtype):
    model = tiny_model(tmp_path_factory, qtype)
    one = check_mixed_batches(model, 1, atol=0.05, kernels="fast")
    two = check_mixed_batches(model, 2, atol=0.05, kernels="fast")
    for s in one:
        np.testing.assert_array_equal(one[s], two[s])


def test_default_model_mixed_batch_logits_equal_the_reference(default_model):
    check_mixed_batches(default_model, 2, atol=1e-3)


def test_default_model_fast_kernels_stay_close_to_the_reference(default_model):
    check_mixed_batches(default_model, 2, atol=0.04, kernels="fast")


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_logits_are_identical_whatever_the_thread_count_and_batch(default_model, kernels):
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 49152, 20).tolist()
    other = rng.integers(3, 49152, 33).tolist()
    assert_logits_alone_equal_logits_beside(default_model, kernels, ids, other)


def assert_logits_alone_equal_logits_beside(model, kernels: str, ids: list[int], other: list[int]) -> None:
    """`ids` prefilled alone and beside `other` in one step, on one thread and on two: the same
    logits bit for bit."""
    results = []
    for n_threads, with_neighbour in ((1, False), (2, False), (2, True), (1, True)):
        driver = StepDriver(model, n_threads, kernels=kernels)
        try:
            driver.add(1, ids)
            if with_neighbour:
                driver.add(2, other)
                rows = driver.step({2: len(other), 1: len(ids)})[1]
            else:
                rows = driver.step({1: len(ids)})[1]
            results.append(rows)
        finally:
            driver.close()
    for rows in results[1:]:
        np.testing.assert_array_equal(rows, results[0])


@pytest.mark.parametrize("kernels", ["exact", "fast", "emulated tiles"])
def test_the_feed_forward_in_passes_gives_the_logits_of_one_pass(tmp_path_factory, monkeypatch, kernels):
    """A step's gated feed-forward runs in passes of a few tokens (their hidden rows exist for one pass):
    prompts of several passes and a remainder, beside decodes, give one pass's logits bit for bit."""
    if kernels == "emulated tiles":
        monkeypatch.setenv("TREADLE_AMX", "emulate")
        kernels = "fast"
    model = tiny_model(tmp_path_factory, QType.Q4_K)
    rng = np.random.default_rng(8)
    tokens = {1: rng.integers(3, model.config.vocab_size, 61).tolist(),
              2: rng.integers(3, model.config.vocab_size, 25).tolist()}  # fmt: skip
    results = []
    for rows in (None, 16, 32):
        driver = StepDriver(model, 2, kernels=kernels, feed_forward_rows=rows)
        try:
            assert driver.runner.state.hb.shape[0] == (rows or 128)
            for s, ids in tokens.items():
                driver.add(s, ids)
            steps = [driver.step({1: 50, 2: 23}), driver.step({1: 10, 2: 1}), driver.step({1: 1, 2: 1})]
            results.append([rows for step in steps for rows in step.values()])
        finally:
            driver.close()
    for passes in results[1:]:
        for a, b in zip(passes, results[0], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_profiled_steps_time_every_phase_and_compute_the_same_logits(tmp_path_factory, kernels):
    shape = TinyShape(n_layers=2, dim=64, hidden_dim=96, n_heads=4, n_kv_heads=2)
    path = write_gguf(tmp_path_factory.mktemp("m") / "post.gguf", shape, qtype=QType.Q8_0, seed=3)
    model = load_model(path)
    rng = np.random.default_rng(2)
    ids = rng.integers(3, model.config.vocab_size, 12).tolist()
    rows = []
    for profiled in (False, True):
        driver = StepDriver(model, 2, kernels=kernels)
        try:
            assert driver.runner.phase_cycles is None
            driver.runner.profile_phases(profiled)
            driver.add(1, ids)
            rows.append(driver.step({1: 12})[1])
            cycles = driver.runner.phase_cycles
        finally:
            driver.close()
    np.testing.assert_array_equal(rows[0], rows[1])
    assert cycles.shape == (len(PHASES),)
    ran = set(PHASES) - {"post-norms", "gather expert rows", "combine experts"}  # a dense llama: none of these
    if kernels == "exact":
        ran -= {"quantize attention", "quantize hidden"}
    for name, count in zip(PHASES, cycles, strict=True):
        assert (count > 0) == (name in ran), name


def test_model_step_reads_every_field_of_its_named_structures_by_name():
    """The step's arguments are named structures: a field added to one and never read (or read under
    another name, which numba refuses when compiling) is a disagreement between runner and kernel."""
    import inspect

    from decoding.kernels import forward

    source = inspect.getsource(forward.model_step.py_func)
    parameters = list(inspect.signature(forward.model_step.py_func).parameters)
    assert parameters == ["tid", "nthreads", "barrier", "fast", "step", "matrices", "packed", "weights", "arch",
                          "key_cache", "value_cache", "scratch"]
    for name, structure in [("step", forward.StepInputs), ("weights", forward.WeightArrays),
                            ("arch", forward.Architecture), ("scratch", forward.StepScratch)]:
        unread = [f for f in structure._fields if f"{name}.{f}" not in source]
        assert unread == [], f"{structure.__name__} fields model_step never reads: {unread}"


def test_a_mapped_file_and_a_converted_directory_give_the_step_the_same_argument_types(tmp_path):
    """numba compiles the step once per argument type: a read-only view of a mapped file where a
    converted model has a writable copy would compile it twice (~40 s of CPU for each cache type)."""
    from numba import typeof

    from decoding.kernels.forward import KernelWeights
    from tests.tinymodel import write_hf_directory

    mapped = load_model(write_gguf(tmp_path / "tiny.gguf"))
    converted = load_model(write_hf_directory(tmp_path / "hf"))
    for fast in (False, True):
        built = [KernelWeights.build(m.config, m.weights, fast=fast) for m in (mapped, converted)]
        types = [(typeof(w.matrices), typeof(w.packed), typeof(w.arrays)) for w in built]
        assert types[0] == types[1]


def test_the_rotary_tables_fill_as_positions_reach_them_with_the_rows_of_the_whole_table(tmp_path):
    """A 128k-position model keeps only the rotary rows its sequences reached; each row is the one the
    whole table would hold, so when a row is filled never changes a token's numbers."""
    from decoding.kernels.forward import ROPE_ROWS_AT_ONCE, KernelWeights
    from decoding.kernels.reference import rope_tables

    model = load_model(write_gguf(tmp_path / "tiny.gguf", TinyShape(max_context=3 * ROPE_ROWS_AT_ONCE)))
    cfg = model.config
    weights = KernelWeights.build(cfg, model.weights, fast=False)
    whole_cos, whole_sin = rope_tables(np.arange(cfg.max_context), cfg.head_dim, cfg.rope_theta)
    assert not weights.arrays.rope_cos.any()

    weights.cover_positions(np.array([5, ROPE_ROWS_AT_ONCE + 3]))
    filled = 2 * ROPE_ROWS_AT_ONCE
    assert weights.rope_rows == filled
    assert np.array_equal(weights.arrays.rope_cos[0, :filled], whole_cos[:filled])
    assert np.array_equal(weights.arrays.rope_sin[0, :filled], whole_sin[:filled])
    assert not weights.arrays.rope_cos[0, filled:].any()

    weights.cover_positions(np.array([cfg.max_context - 1]))
    assert np.array_equal(weights.arrays.rope_cos[0], whole_cos)
    assert np.array_equal(weights.arrays.rope_sin[0], whole_sin)
    with pytest.raises(ValueError, match="past the model's"):
        weights.cover_positions(np.array([cfg.max_context]))
