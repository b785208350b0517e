"""Memory at start: `--kv-cache-mb auto` and the refusal of a model + KV cache that cannot fit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from decoding.engine import memory
from decoding.engine.engine import Engine, EngineConfig

GIB = 1 << 30


def meminfo(tmp_path, available_kib: int):
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       24000000 kB\nMemFree:        1000 kB\nMemAvailable:   {available_kib} kB\n"
    )
    return path


def test_memavailable_is_the_budget_unless_the_cgroup_allows_less(tmp_path):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    budget = memory.available_memory(meminfo(tmp_path, 8 * 1024 * 1024), cgroup)
    assert budget == memory.MemoryBudget(8 * GIB, "MemAvailable")
    (cgroup / "memory.max").write_text(str(3 * GIB))
    (cgroup / "memory.current").write_text(str(1 * GIB))
    assert memory.available_memory(meminfo(tmp_path, 8 * 1024 * 1024), cgroup) == memory.MemoryBudget(
        2 * GIB, "the cgroup's memory.max"
    )


def test_auto_takes_half_of_what_the_weights_and_margin_leave_and_no_more_than_is_useful():
    budget = memory.MemoryBudget(10 * GIB, "MemAvailable")
    spare = 10 * GIB - 4 * GIB - memory.RUNTIME_MARGIN_BYTES
    assert memory.auto_kv_bytes(4 * GIB, 100 * GIB, budget) == spare // 2
    assert memory.auto_kv_bytes(4 * GIB, 1 * GIB, budget) == 1 * GIB
    assert memory.auto_kv_bytes(12 * GIB, 100 * GIB, budget) == 0


def test_a_model_and_cache_that_do_not_fit_are_refused_with_their_sizes():
    with pytest.raises(
        memory.NotEnoughMemory, match=r"weights \(4,096 MiB\).*KV cache of 6,144 MiB.*8,192 MiB is"
    ):
        memory.check_fits(4 * GIB, 6 * GIB, memory.MemoryBudget(8 * GIB, "MemAvailable"))
    memory.check_fits(4 * GIB, 3 * GIB, memory.MemoryBudget(8 * GIB, "MemAvailable"))


def test_the_engine_refuses_a_cache_larger_than_memory_before_allocating_it(default_model):
    with pytest.raises(memory.NotEnoughMemory, match="KV cache"):
        Engine(default_model, EngineConfig(kv_cache_mb=64 * 1024 * 1024))  # 64 TiB


def test_auto_sizes_the_cache_from_available_memory_within_what_sequences_can_use(default_model):
    engine = Engine(default_model, EngineConfig(kv_cache_mb="auto", max_num_seqs=2, max_model_len=1024))
    try:
        spec = engine.storage.spec
        assert 0 < engine.storage.num_blocks * spec.block_size <= 2 * 1024
        budget = memory.available_memory()
        assert engine.storage.num_blocks * spec.bytes_per_block < budget.available
    finally:
        engine.shutdown()


def test_treadle_serve_says_what_does_not_fit_and_exits():
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--kv-cache-mb", str(64 * 1024 * 1024), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "KV cache of" in result.stderr and "MiB is available" in result.stderr
