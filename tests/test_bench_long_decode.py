"""`treadle bench long-decode`: a decode step at long contexts over a cache filled without a prefill."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.long_decode import _fill_random, add_roof, kv_bytes_read, measure, report
from bench.synth import write_model
from decoding import load_model
from kvcache.storage import KVCacheSpec, KVCacheStorage

GOLDEN_GEMMA3 = Path(__file__).parent / "golden" / "architectures" / "gemma3"


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, default_model):
    path = tmp_path_factory.mktemp("long-decode") / "tiny.gguf"
    write_model("tiny", path, tokenizer=default_model.path)
    return path


def test_an_int8_cache_is_filled_with_the_scales_attention_reads():
    spec = KVCacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, block_size=16, dtype="int8")
    storage = KVCacheStorage.allocate(spec, 3)
    _fill_random(storage, np.random.default_rng(0))
    for cache in (storage.key_cache, storage.value_cache):  # a tile's values, then its (groups, keys) scales
        tiles = cache.reshape(*cache.shape[:3], -1)
        scales = tiles[..., 64 * 16 :].view(np.float16)
        assert scales.shape == (2, 2, 3, 2 * 16) and (scales == np.float16(1 / 127)).all()
        values = tiles[..., : 64 * 16]
        assert values.min() >= -127 and values.max() <= 127 and len(np.unique(values)) > 200


def test_each_context_and_cache_type_gets_a_step_time_and_its_kv_bytes(tiny_file):
    results = measure(tiny_file, [16, 300], ["float16", "int8"], threads=2, steps=2)
    for dtype in ("float16", "int8"):
        short, long = results["runs"][dtype]
        assert short["context"] == 16 and long["context"] == 300
        assert short["ms_per_token"] > 0 and long["ms_per_token"] > 0
        assert short["paired_ratio"] == 1.0 and long["paired_ratio"] > 0  # each round's steps over its shortest's
        spec = KVCacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
        assert long["kv_mb_read"] == pytest.approx(300 * spec.bytes_per_token / 1e6)
    table = report(results)
    assert "| 300 |" in table and "float16" in table and "int8" in table


def test_a_sliding_window_layer_counts_only_the_keys_it_reads():
    """Gemma 3's layout (tests/golden/architectures/gemma3: two sliding layers of window 10, then one
    global layer; one KV head of 256): past the window a step reads 10 keys on each sliding layer."""
    model = load_model(GOLDEN_GEMMA3)
    spec = KVCacheSpec(n_layers=3, n_kv_heads=1, head_dim=256, block_size=16, dtype="float16")
    token_layer = 2 * 256 * 2  # K and V of one token on one layer, half floats
    assert kv_bytes_read(model.config, spec, 8) == 3 * 8 * token_layer
    assert kv_bytes_read(model.config, spec, 100) == (100 + 2 * 10) * token_layer
    results = measure(GOLDEN_GEMMA3, [16, 100], ["float16"], threads=1, steps=1)
    assert [run["kv_mb_read"] for run in results["runs"]["float16"]] == pytest.approx(
        [(16 + 2 * 10) * token_layer / 1e6, (100 + 2 * 10) * token_layer / 1e6])


def test_the_block_size_is_the_servers_option_and_recorded(tiny_file):
    results = measure(tiny_file, [16, 300], ["int8"], threads=1, steps=1, block_size=32)
    assert results["block_size"] == 32 and results["runs"]["int8"][1]["ms_per_token"] > 0


def test_a_context_past_the_models_positions_is_refused(tiny_file):
    limit = load_model(tiny_file).config.max_context
    with pytest.raises(SystemExit, match=f"trained for {limit} positions"):
        measure(tiny_file, [16, limit + 1], ["float16"], threads=1, steps=1)


def test_the_roof_is_the_time_the_extra_kv_bytes_take_at_the_measured_bandwidth():
    results = {"runs": {"int8": [{"context": 1024, "ms_per_token": 30.0, "paired_ratio": 1.0, "kv_mb_read": 16.0},
                                 {"context": 32768, "ms_per_token": 55.0, "paired_ratio": 1.8,
                                  "kv_mb_read": 516.0}]}}  # fmt: skip
    add_roof(results, read_gb_s=25.0)
    long = results["runs"]["int8"][1]
    assert long["extra_kv_mb"] == 500
    assert long["extra_kv_gb_s"] == pytest.approx(500 / 25)  # 500 MB more in 25 ms more
    assert long["roof_ratio"] == pytest.approx(1 + 20 / 30)  # 500 MB at 25 GB/s: 20 ms on top of 30
    assert "at 20.0 GB/s, 80% of the 25.0 GB/s" in report({**results, "model": "m.gguf", "threads": 2,
                                                           "contexts": [1024, 32768]})  # fmt: skip
