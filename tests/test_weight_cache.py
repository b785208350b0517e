"""The weight cache: repacked matrices written at a model's first start and mapped at the next ones."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from bench.synth import write_model
from decoding import load_model
from decoding.kernels import weight_cache
from decoding.kernels.forward import KernelWeights


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory, default_model):
    """A small file of Q4_K and Q6_K matrices (the synthetic tiny shape)."""
    path = tmp_path_factory.mktemp("weights") / "tiny-q4km.gguf"
    write_model("tiny", path, tokenizer=default_model.path)
    return path


def build(path, cache):
    model = load_model(path)
    return KernelWeights.build(model.config, model.weights, fast=True, cache=cache)


def test_the_first_build_writes_the_file_and_the_next_maps_the_same_bytes(quantized_file, tmp_path, caplog):
    cache = weight_cache.cache_file(quantized_file, tmp_path)
    in_memory = build(quantized_file, None)
    written = build(quantized_file, cache)
    assert cache.is_file()
    with caplog.at_level(logging.INFO, logger="decoding.kernels.forward"):
        mapped = build(quantized_file, cache)
    assert "mapped from" in caplog.text
    for a, b, c in zip(
        [*in_memory.packed, in_memory.arrays.lm_head_packed],
        [*written.packed, written.arrays.lm_head_packed],
        [*mapped.packed, mapped.arrays.lm_head_packed],
        strict=True,
    ):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert sum(a.nbytes for a in mapped.packed) > 0
    assert not mapped.packed[0].flags.owndata  # a view of the map, not a copy


def test_a_changed_model_file_misses_and_its_older_cache_is_removed(quantized_file, tmp_path):
    first = weight_cache.cache_file(quantized_file, tmp_path)
    build(quantized_file, first)
    stat = quantized_file.stat()
    os.utime(quantized_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = weight_cache.cache_file(quantized_file, tmp_path)
    assert second != first
    build(quantized_file, second)
    assert second.is_file() and not first.exists()


def test_models_whose_names_share_a_dotted_prefix_keep_their_own_caches(tmp_path):
    """qwen2.5-1.5b and qwen2.5-7b are two models, not two versions of "qwen2": building one's cache
    must not remove the other's."""
    other_model = tmp_path / "qwen2.5-1.5b-q4_k_m.0123456789abcdef.packed"
    weight_cache.build(other_model, [16], lambda i: np.zeros(16, np.uint8))
    older_version = tmp_path / "qwen2.5-7b-q4_k_m.fedcba9876543210.packed"
    weight_cache.build(older_version, [16], lambda i: np.zeros(16, np.uint8))
    weight_cache.build(tmp_path / "qwen2.5-7b-q4_k_m.00112233445566ff.packed", [16],
                       lambda i: np.zeros(16, np.uint8))
    assert other_model.is_file(), "another model's cache was removed"
    assert not older_version.exists(), "the same model's older cache stays"


@pytest.mark.parametrize("damage", ["truncated", "foreign", "garbage"])
def test_a_damaged_or_foreign_file_is_ignored_and_rewritten(quantized_file, tmp_path, damage, caplog):
    cache = weight_cache.cache_file(quantized_file, tmp_path)
    reference = build(quantized_file, None)
    build(quantized_file, cache)
    data = cache.read_bytes()
    if damage == "truncated":
        cache.write_bytes(data[: len(data) // 2])
    elif damage == "foreign":  # a whole cache file made for another model, under this name
        other = tmp_path / "other.packed"
        weight_cache.build(other, [16, 32], lambda i: np.zeros(16 * (i + 1), np.uint8))
        cache.write_bytes(other.read_bytes())
    else:
        cache.write_bytes(b"not a weight cache" * 100)
    with caplog.at_level(logging.WARNING, logger="decoding.kernels.weight_cache"):
        rebuilt = build(quantized_file, cache)
    assert "ignoring the weight cache" in caplog.text
    assert all(np.array_equal(a, b) for a, b in zip(reference.packed, rebuilt.packed, strict=True))
    assert weight_cache.load(cache, [a.nbytes for a in reference.packed] + [reference.arrays.lm_head_packed.nbytes])


def test_an_unwritable_directory_repacks_in_memory(quantized_file, tmp_path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    weights = build(quantized_file, weight_cache.cache_file(quantized_file, blocked))
    assert sum(a.nbytes for a in weights.packed) > 0 and weights.packed[0].flags.owndata


def test_the_engine_serves_the_same_tokens_from_the_cache(quantized_file, tmp_path, monkeypatch):
    from decoding.engine.engine import Engine, EngineConfig
    from decoding.engine.params import SamplingParams

    monkeypatch.setenv(weight_cache.WEIGHT_CACHE_DIR_ENV, str(tmp_path))
    model = load_model(quantized_file)
    outputs = []
    for use_cache in (False, True, True):  # repacked in memory, written, mapped
        engine = Engine(model, EngineConfig(kv_cache_mb=16, weight_cache=use_cache)).start()
        try:
            outputs.append(
                engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
            )
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1] == outputs[2]
    assert list(tmp_path.glob("*.packed"))
