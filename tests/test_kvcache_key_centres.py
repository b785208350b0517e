"""An int8 KV cache stores each key less its layer's and head's centre (kvcache.key_centres): the
centres are the mean stored key of a fixed text, the step subtracts them before quantizing, attention
is unchanged, and every server of a configuration measures — or loads — the same centres."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from decoding import load_model
from decoding.engine import key_calibration
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from kvcache import key_centres
from kvcache.attention import rotate_q8_groups, write_kv_rows
from kvcache.storage import Q8_GROUP, KVCacheSpec, KVCacheStorage
from tests.real_models import qwen25_coder_05b
from tests.tinymodel import TinyShape, write_gguf

PROMPT = "The quick brown fox jumps over the lazy dog while the weaver counts threads and sings. " * 3


def rotated(keys: np.ndarray) -> np.ndarray:
    """Keys as an int8 cache stores them before centring: each Q8_GROUP values Hadamard-rotated."""
    rows = np.array(keys, dtype=np.float32).reshape(-1, keys.shape[-1])
    for row in rows:
        rotate_q8_groups(row, row.shape[0])
    return rows.reshape(keys.shape)


def test_dequantized_keys_are_the_written_keys_within_half_a_step():
    spec = KVCacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, block_size=8, dtype="int8")
    storage = KVCacheStorage.allocate(spec, 5)
    rng = np.random.default_rng(3)
    keys = (rng.standard_normal((37, 2, 64)) * rng.uniform(0.1, 20, (1, 2, 64))).astype(np.float32)
    slots = rng.permutation(5 * 8)[:37].astype(np.int32)
    write_kv_rows(keys, keys.copy(), storage.key_cache[0], storage.value_cache[0], slots, 0, 1)

    stored = key_centres.dequantize_keys(storage.key_cache[0], 64)  # (heads, blocks, block_size, head_dim)
    got = stored[:, slots // 8, slots % 8].swapaxes(0, 1)  # (tokens, heads, head_dim)
    step = np.abs(keys).reshape(37, 2, -1, Q8_GROUP).max(axis=-1) / 127  # each group's grid
    error = np.abs(got - keys).reshape(37, 2, -1, Q8_GROUP).max(axis=-1)
    assert np.all(error <= 0.6 * step)  # half a step, and the fp16 scale's rounding
    assert not np.array_equal(stored, 0)


def test_centres_are_the_mean_key_past_the_skipped_positions():
    spec = KVCacheSpec(n_layers=2, n_kv_heads=1, head_dim=32, block_size=4, dtype="int8")
    storage = KVCacheStorage.allocate(spec, 8)
    rng = np.random.default_rng(5)
    num_tokens, block_ids = 22, np.array([6, 1, 4, 0, 7, 2], dtype=np.int32)  # a sequence's scattered blocks
    positions = np.arange(num_tokens)
    slots = (block_ids[positions // 4] * 4 + positions % 4).astype(np.int32)
    keys = np.empty((2, num_tokens, 1, 32), dtype=np.float32)
    for layer in range(2):
        keys[layer] = 5.0 * (layer + 1) + rng.standard_normal((num_tokens, 1, 32)).astype(np.float32)
        keys[layer, : key_centres.SKIPPED_POSITIONS] = 1000.0  # attention sinks: left out
        write_kv_rows(keys[layer], keys[layer], storage.key_cache[layer], storage.value_cache[layer], slots, 0, 1)

    centres = key_centres.centres_from_cache(storage, block_ids, num_tokens)
    expected = keys[:, key_centres.SKIPPED_POSITIONS :, 0].mean(axis=1)
    assert centres.shape == (2, 32) and centres.dtype == np.float32
    np.testing.assert_allclose(centres, expected, atol=0.05)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A llama with heads of 64 (an int8 cache needs a multiple of 32)."""
    shape = TinyShape(dim=128, hidden_dim=192, n_heads=2, n_kv_heads=1)
    return load_model(str(write_gguf(tmp_path_factory.mktemp("centres") / "tiny.gguf", shape)))


def prefill(engine: Engine, token_ids: list[int]) -> tuple[np.ndarray, KVCacheStorage]:
    """Every row's logits of `token_ids` prefilled by the engine's runner into a cache of its own."""
    return key_calibration.prefill_alone(engine.runner, token_ids, every_row=True)


def stored_keys(storage: KVCacheStorage, num_tokens: int) -> np.ndarray:
    """(layers, kv heads, tokens, head_dim) float32 of a sequence in blocks 0, 1, ... of `storage`."""
    spec = storage.spec
    tiles = storage.key_cache
    if spec.dtype == "int8":
        keys = key_centres.dequantize_keys(tiles, spec.head_dim)
    else:
        keys = tiles.astype(np.float32).swapaxes(-1, -2)  # float32 tiles: (head_dim, block_size) transposed
    return keys.reshape(spec.n_layers, spec.n_kv_heads, -1, spec.head_dim)[:, :, :num_tokens]


def assert_stored(got: np.ndarray, expected: np.ndarray) -> None:
    """The first layer's keys within the int8 grid's rounding; later layers' also carry the int8
    attention's error of the layers before them."""
    grid = np.abs(expected).max() / 127
    np.testing.assert_allclose(got[0], expected[0], atol=0.6 * grid)
    np.testing.assert_allclose(got, expected, atol=4 * grid)


def engine(model, **config) -> Engine:
    return Engine(model, EngineConfig(**{"kv_cache_mb": 8, "weight_cache": False, **config}))


def test_the_step_stores_keys_less_their_centres_and_attention_is_unchanged(tiny_model):
    ids = tiny_model.tokenizer.encode(PROMPT)[:80]
    exact = engine(tiny_model, kv_cache_dtype="float32")
    centred = engine(tiny_model, kv_cache_dtype="int8")
    try:
        reference, float_cache = prefill(exact, ids)
        centres = centred.runner.weights.arrays.key_centres
        assert np.abs(centres).max() > 0.1, "the calibration found no common part to take away"
        logits, int8_cache = prefill(centred, ids)
        float_keys = rotated(stored_keys(float_cache, len(ids)))  # int8 caches hold rotated keys
        layers, heads = centres.shape[0], float_cache.spec.n_kv_heads
        expected = float_keys - centres.reshape(layers, heads, 1, -1)
        assert_stored(stored_keys(int8_cache, len(ids)), expected)
        # the same subtraction from every key of a head: the softmax takes it away
        np.testing.assert_allclose(logits, reference, atol=0.2)
        # (not the argmax: a random model's near-ties may go either way with another CPU's rounding)
        assert np.abs(logits - reference).mean() < 0.03  # 0.011 measured

        # without centres the keys are stored whole, and the centres measured are their mean
        centred.runner.set_key_centres(np.zeros_like(centres))
        _, uncentred_cache = prefill(centred, ids)
        assert_stored(stored_keys(uncentred_cache, len(ids)), float_keys)
    finally:
        exact.shutdown()
        centred.shutdown()


def test_calibration_measures_the_mean_rotated_key_of_the_calibration_text(tiny_model):
    exact = engine(tiny_model, kv_cache_dtype="float32")
    centred = engine(tiny_model, kv_cache_dtype="int8")
    try:
        ids = key_calibration.calibration_tokens(tiny_model.tokenizer, tiny_model.config.max_context)
        assert len(ids) == key_centres.CALIBRATION_TOKENS
        _, float_cache = prefill(exact, ids)
        float_keys = rotated(stored_keys(float_cache, len(ids)))
        mean = float_keys[:, :, key_centres.SKIPPED_POSITIONS :].mean(axis=2).reshape(float_keys.shape[0], -1)
        np.testing.assert_allclose(centred.runner.weights.arrays.key_centres, mean,
                                   atol=0.02 * np.abs(float_keys).max())  # fmt: skip
    finally:
        exact.shutdown()
        centred.shutdown()


@pytest.mark.parametrize("max_context", [4, 64])
def test_a_model_with_fewer_positions_than_the_text_calibrates_on_those_it_has(tmp_path, max_context):
    shape = TinyShape(dim=128, hidden_dim=192, n_heads=2, n_kv_heads=1, max_context=max_context)
    model = load_model(str(write_gguf(tmp_path / "short.gguf", shape)))
    e = engine(model, kv_cache_dtype="int8", max_num_seqs=4, max_num_batched_tokens=64).start()
    try:
        centres = e.runner.weights.arrays.key_centres
        assert np.all(np.isfinite(centres))
        assert centres.any() == (max_context > key_centres.SKIPPED_POSITIONS)  # 4 positions: all skipped
        assert e.generate(model.tokenizer.encode("ab"), SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    finally:
        e.shutdown()


@pytest.mark.parametrize("kernels", ["fast", "exact"])
def test_every_server_of_a_configuration_measures_the_same_centres(tiny_model, kernels):
    """Prefix tiers share blocks between servers and restarts: their keys must have the same centres
    whatever the threads and the step's token budget."""
    measured = []
    for config in ({"n_threads": 2, "max_num_batched_tokens": 256}, {"n_threads": 1, "max_num_batched_tokens": 256},
                   {"n_threads": 2, "max_num_batched_tokens": 16, "max_num_seqs": 8}):  # fmt: skip
        e = engine(tiny_model, kv_cache_dtype="int8", kernels=kernels, **config)
        measured.append(e.runner.weights.arrays.key_centres.copy())
        e.shutdown()
    assert all(np.array_equal(measured[0], other) for other in measured[1:])


def test_centres_are_kept_beside_the_weight_cache_and_loaded_at_the_next_start(tiny_model, tmp_path, monkeypatch,
                                                                            caplog):  # fmt: skip
    monkeypatch.setenv("TREADLE_WEIGHT_CACHE_DIR", str(tmp_path))
    config = EngineConfig(kv_cache_mb=8, kv_cache_dtype="int8")
    first = Engine(tiny_model, config)
    centres = first.runner.weights.arrays.key_centres.copy()
    first.shutdown()
    (kept,) = tmp_path.glob("*.key-centres.npy")
    np.testing.assert_array_equal(np.load(kept), centres)

    def no_measuring(*args):
        raise AssertionError("the kept centres were measured again")

    with monkeypatch.context() as patch:
        patch.setattr(key_calibration, "measure_key_centres", no_measuring)
        second = Engine(tiny_model, config)
        np.testing.assert_array_equal(second.runner.weights.arrays.key_centres, centres)
        second.shutdown()

    older_code = kept.with_name(kept.name.replace(kept.name.split(".")[-3], "0123456789abcdef"))
    np.save(older_code, centres + 1)  # the same model and configuration, older code
    kept.write_bytes(b"torn")  # a foreign or torn file is measured again and replaced
    with caplog.at_level(logging.WARNING, logger="kvcache.key_centres"):
        third = Engine(tiny_model, config)
    np.testing.assert_array_equal(third.runner.weights.arrays.key_centres, centres)
    third.shutdown()
    assert "ignoring unreadable key centres" in caplog.text
    np.testing.assert_array_equal(np.load(kept), centres)
    assert not older_code.exists()  # another code's file under the same name went with the new one

    other_blocks = Engine(tiny_model, EngineConfig(kv_cache_mb=8, kv_cache_dtype="int8", block_size=8))
    other_blocks.shutdown()
    assert len(list(tmp_path.glob("*.key-centres.npy"))) == 2  # another namespace, another file

    float_cache = Engine(tiny_model, EngineConfig(kv_cache_mb=8, kv_cache_dtype="float16"))
    assert not float_cache.runner.weights.arrays.key_centres.any()  # only an int8 cache centres its keys
    float_cache.shutdown()


def test_centring_halves_the_int8_caches_error_on_qwen(tmp_path_factory):
    """Qwen2.5's keys share a large common part (its K bias): taken away, the int8 grid is finer."""
    model = load_model(str(qwen25_coder_05b(tmp_path_factory.mktemp("qwen"))))
    ids = model.tokenizer.encode(PROMPT)[:64]
    engines = [engine(model, kv_cache_dtype=dtype, kv_cache_mb=64) for dtype in ("float32", "int8")]
    try:
        reference, _ = prefill(engines[0], ids)
        centred, _ = prefill(engines[1], ids)
        engines[1].runner.set_key_centres(np.zeros_like(engines[1].runner.weights.arrays.key_centres))
        uncentred, _ = prefill(engines[1], ids)
    finally:
        for e in engines:
            e.shutdown()
    centred_error, uncentred_error = np.abs(centred - reference).mean(), np.abs(uncentred - reference).mean()
    assert centred_error < 0.6 * uncentred_error, (centred_error, uncentred_error)
