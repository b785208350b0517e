"""`treadle bench engine --peers`: reading a peer script's output, the reasons a peer is skipped, and the
treadle / transformers table (no peer is measured here)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.engine import run_closed_loop
from bench.engine_peers import TRANSFORMERS_BATCH, peer_result, run_transformers
from bench.engine_report import format_transformers
from bench.engine_rooflines import measure_int8_gmacs
from decoding import load_model
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.kernels.amx import EMULATED

pytestmark = pytest.mark.timeout(60)

PEER = {
    "transformers_version": "5.24.0",
    "torch_version": "2.13.0+cpu",
    "dtype": "float32",
    "threads": 2,
    "decode_tokens_per_second": 25.0,
    "batched_tokens_per_second": {str(TRANSFORMERS_BATCH): 200.0},
    "prompt_tokens_per_second": 400.0,
}


def report(peer: dict, levels: tuple[int, ...] = (1, TRANSFORMERS_BATCH)) -> dict:
    tokens_per_second = {1: 50.0, TRANSFORMERS_BATCH: 300.0}
    return {
        "single_stream_tokens_per_second": 50.0 if 1 in levels else None,
        "levels": [{"concurrency": c, "tokens_per_second": tokens_per_second[c]} for c in levels],
        "prefill_tokens_per_second": 200.0,
        "prefill_prompt_tokens": 512,
        "transformers": peer,
    }


def test_peer_result_reads_the_last_stdout_line() -> None:
    assert peer_result("transformers", 0, 'loading\n{"decode_tokens_per_second": 25.0}\n', "") == {
        "decode_tokens_per_second": 25.0
    }


TRACEBACK = "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n"


@pytest.mark.parametrize(
    ("returncode", "stdout", "reason"),
    [
        (1, "", f"transformers peer failed (exit 1): {TRACEBACK.strip()}"),
        (0, "", f"transformers peer failed (exit 0): {TRACEBACK.strip()}"),
        (0, "not json\n", "transformers peer printed no JSON: not json"),
    ],
)
def test_a_failed_peer_is_a_reason_not_an_exception(returncode: int, stdout: str, reason: str) -> None:
    assert peer_result("transformers", returncode, stdout, TRACEBACK) == {"skipped": reason}


def test_the_reason_keeps_the_end_of_a_long_traceback() -> None:
    stderr = "x" * 1000 + "\nRuntimeError: boom"
    reason = peer_result("transformers", 1, "", stderr)["skipped"]
    assert reason.endswith("RuntimeError: boom") and len(reason) < 400


def test_missing_bench_venv_says_how_to_install(tmp_path: Path) -> None:
    result = run_transformers(tmp_path / "m.gguf", "m", 2, [1, 2, 3], 8, 16, python=tmp_path / "no-python")
    assert result["skipped"].startswith("not installed:")
    assert "make bench" in result["skipped"]


def test_a_model_that_is_not_a_gguf_is_skipped(tmp_path: Path) -> None:
    result = run_transformers(tmp_path / "model.safetensors", "m", 2, [1], 8, 16, python=Path(sys.executable))
    assert result == {"skipped": "needs a checkout with bench/ and a GGUF model"}


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="would measure for real")
def test_peer_script_without_torch_reports_not_installed(tmp_path: Path) -> None:
    # .venv never has torch: the real script, run by this Python, stops at its import and says so.
    result = run_transformers(tmp_path / "m.gguf", "m", 2, [1, 2, 3], 8, 16, python=Path(sys.executable))
    assert result["skipped"].startswith("not installed: No module named 'torch'")
    assert result["skipped"].endswith("run make bench")


def test_table_gives_treadle_over_transformers() -> None:
    lines = format_transformers(report(PEER)).splitlines()
    assert lines[0].startswith("transformers 5.24.0 (torch 2.13.0+cpu, float32, 2 threads")
    rows = {line[:26].strip(): line[26:].split() for line in lines[2:]}
    assert rows == {
        "single-stream decode": ["50.0", "25.0", "2.00×"],
        f"{TRANSFORMERS_BATCH} streams, aggregate": ["300.0", "200.0", "1.50×"],
        "prompt, 512 tokens": ["200.0", "400.0", "0.50×"],
    }


def test_table_leaves_a_dash_where_treadle_has_no_matching_level() -> None:
    lines = format_transformers(report(PEER, levels=(1,))).splitlines()
    assert lines[3].split()[-3:] == ["—", "200.0", "—"]
    lines = format_transformers(report(PEER, levels=(TRANSFORMERS_BATCH,))).splitlines()
    assert lines[2].split()[-3:] == ["—", "25.0", "—"]


def test_table_says_why_transformers_was_skipped() -> None:
    reason = "not installed: No module named 'torch' in .venv-bench; run make bench"
    assert format_transformers(report({"skipped": reason})) == f"transformers: {reason}"


def test_int8_compute_ceiling_is_measured_on_the_pool_and_skipped_for_float_weights(default_model, tiny_gguf):
    one, two = measure_int8_gmacs(default_model, 1), measure_int8_gmacs(default_model, 2)
    assert one > 1 and two > 1  # GMAC/s of real VNNI (or plain-vector) dot products
    assert measure_int8_gmacs(load_model(tiny_gguf), 1) is None  # float32 weights: nothing to repack
    assert measure_int8_gmacs(default_model, 1, tile_mode=EMULATED) > 0.1  # the AMX roof's path, emulated here


def test_closed_loop_keeps_every_slot_busy_and_counts_whole_answers(default_model) -> None:
    engine = Engine(default_model, EngineConfig(max_num_seqs=4, n_threads=1, kv_cache_mb=64)).start()
    submitted: list[int] = []
    try:
        def params(seed: int) -> SamplingParams:
            submitted.append(seed)
            return SamplingParams(max_tokens=6, temperature=0.8, seed=seed, ignore_eos=True)

        result = run_closed_loop(engine, default_model.tokenizer.encode("Hello"), 3, 0.5, params)
    finally:
        engine.shutdown()
    assert result.concurrency == 3 and result.tokens_per_second > 0
    assert result.mean_answer_tokens == 6  # every answer ran to its max_tokens, none was cut by the window
    per_slot = Counter(seed // 1000 for seed in submitted)
    assert sorted(per_slot) == [0, 1, 2] and min(per_slot.values()) > 1  # each finished answer was replaced
