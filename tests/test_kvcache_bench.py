"""The KV benchmark's simulations: deterministic figures that move the right way."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import kv as bench


def test_paging_holds_several_times_more_tokens_per_mib_than_max_context_buffers() -> None:
    contiguous, paged, shared = bench.memory_efficiency(np.random.default_rng(0), num_seqs=16)
    assert contiguous["tokens"] == paged["tokens"] == shared["tokens"]
    assert paged["tokens_per_mib"] > 5 * contiguous["tokens_per_mib"]
    # Paged waste is under one block per sequence; sharing the system prompt holds even more.
    assert paged["kv_mib"] < (paged["tokens"] + 16 * 16) * bench.SPEC.bytes_per_token / bench.MIB
    assert shared["tokens_per_mib"] > paged["tokens_per_mib"]


def test_chat_replay_hits_more_with_a_larger_cache() -> None:
    rates = [
        bench.chat_replay(np.random.default_rng(1), mb, num_conversations=12)["hit_rate"]
        for mb in (128, None)
    ]
    assert 0 < rates[0] < rates[1] < 1


@pytest.mark.parametrize("num_threads", [1, 2])
def test_attention_timings_cover_every_shape(num_threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "DECODE_SHAPES", ((2, 40, 1), (1, 17, 1)))
    monkeypatch.setattr(bench, "PREFILL_SHAPES", ((1, 30, 9),))
    rows = bench.attention_times(np.random.default_rng(2), num_threads, repeats=1)
    rows += bench.attention_times(np.random.default_rng(2), num_threads, prefill=True, repeats=1)
    shapes = [(r["kv"], r["batch"], r["context"], r["query_rows"], r["threads"]) for r in rows]
    assert shapes == [
        (kv, *shape, num_threads)
        for shape in ((2, 40, 1), (1, 17, 1), (1, 30, 9))
        for kv in ("float32", "float16", "int8")
    ]
    assert all(r["us_per_layer"] > 0 for r in rows)


def test_main_writes_the_figures_as_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "DECODE_SHAPES", ((1, 16, 1),))
    monkeypatch.setattr(bench, "PREFILL_SHAPES", ((1, 16, 4),))
    monkeypatch.setattr(bench, "CHAT_CACHE_MIB", (None,))
    path = tmp_path / "kv.json"
    assert bench.main(["--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert set(results) == {"model", "memory", "prefix_cache", "decode_attention", "prefill_attention"}


def test_head_layouts_time_each_layout_and_cache_type(tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    assert bench.main(["--head-layouts", "100", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["layout"], r["kv"]) for r in rows] == [
        (name, kv) for name, *_ in bench.HEAD_LAYOUTS for kv in ("float16", "int8")
    ]
    assert all(r["context"] == 100 and r["us_per_layer"] > 0 and r["ns_per_block_and_kv_head"] > 0 for r in rows)


def test_the_quality_check_compares_each_cache_with_float16_under_each_kernel_mode(default_model) -> None:
    """`bench kv --quality`'s measure on a short text: an int8 cache and the float32 floor against float16,
    per kernel mode, the int8 cache with and without key centres under the fast kernels; the exact
    kernels' float32 cache, which differs from float16 only in the last bits of each key and value,
    agrees on nearly every position (a misaligned comparison would not)."""
    from bench.engine_quality import kv_cache_agreement

    result = kv_cache_agreement(default_model, 128, chunk=64)
    assert result["positions"] == 128 and result["reference"] == "float16"
    assert set(result["fast"]) == {"int8", "float32", "int8_no_key_centres"}
    assert set(result["exact"]) == {"int8", "float32"}
    for mode in ("fast", "exact"):
        for figures in result[mode].values():
            assert 0.5 < figures["all"] <= 1 and 0.5 < figures["second_halves"] <= 1
    assert result["exact"]["float32"]["all"] >= 0.97


def test_the_group_kernel_is_timed_for_each_head_count_and_cache_type(tmp_path: Path) -> None:
    out = tmp_path / "kernel.json"
    assert bench.main(["--group-kernel", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["kv"], r["heads_a_call"]) for r in rows] == [("int8", h) for h in range(1, 9)] + [
        ("float16", h) for h in range(1, 5)]
    assert [r["blocks_a_call"] for r in rows] == [2] * 8 + [1] * 4
    assert all(r["ns_per_block"] > 0 and r["ns_per_head"] * r["heads_a_call"] == pytest.approx(r["ns_per_block"], 0.01)
               for r in rows)  # fmt: skip
