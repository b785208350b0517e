"""The pool benchmark's bookkeeping: timing helpers, ratios and the report (no timing asserted)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.pool_report import TARGETS, compute_ratios, format_report, paired_ratio
from bench.pool_steps import MATVEC_OP, OP_KINDS, TINY_OP, make_operands, step_serial
from bench.pool_timing import time_interleaved

pytestmark = pytest.mark.timeout(120)


def test_time_interleaved_times_every_action_in_several_blocks() -> None:
    calls = {"a": 0, "b": 0}

    def count(name: str) -> None:
        calls[name] += 1

    timed = time_interleaved({"a": lambda: count("a"), "b": lambda: count("b")}, budget_s=0.01, rounds=3)
    assert set(timed) == {"a", "b"}
    for name, stats in timed.items():
        assert stats["reps"] >= 3 * 3  # at least 3 per block
        assert calls[name] == stats["reps"] + 1  # plus the warm-up
        assert 0 <= stats["p10"] <= stats["median"] <= stats["p90"] <= stats["max"]


@pytest.mark.parametrize("kind", [TINY_OP, MATVEC_OP])
def test_step_operands_stay_finite_over_a_step(kind: int) -> None:
    weights, buffers = make_operands(kind)
    step_serial(kind, weights, buffers, 300)
    assert np.isfinite(buffers).all()
    if kind == MATVEC_OP:
        assert buffers[0].std() > 0.01  # tanh(W x) did not collapse to a constant vector


def fake_stats(median: float) -> dict[str, float]:
    return {"median": median, "p10": median, "p90": median, "p99": median, "max": median, "reps": 10}


def fake_report() -> dict:
    kinds = list(OP_KINDS)
    in_process = ["SpinPool (one run, spin barriers)", "serial (1 thread, no sync)"]
    layer = {kind: fake_stats(300.0) for kind in kinds} | {
        kind + " SpinPool (paired)": fake_stats(50.0) for kind in kinds}
    return {
        "machine": {"cpu": "test", "usable_cores": 2, "numba": "0", "load_average_before": [0, 0, 0],
                    "load_average_after": [0, 0, 0]},
        "barrier_ns": {1: fake_stats(1.0), 2: fake_stats(60.0)},
        "pool_run_us": {"spinning": fake_stats(2.0), "from_parked": fake_stats(30.0)},
        "steps_us": {kind: {name: fake_stats(40.0) for name in in_process} for kind in kinds},
        "prange_us": {"omp": layer, "tbb": {"error": "libtbb.so.12: cannot open shared object file"}},
        "idle_cpu_percent": {"parks after 100 us": 0.1, "spins forever": 99.0},
        "asyncio": {"no pool (baseline)": {"loop_lateness_ms": fake_stats(0.1)},
                    "pool busy, workers pinned": {"loop_lateness_ms": fake_stats(0.2), "step_ms": fake_stats(2.0)}},
    }


def test_ratios_use_the_paired_measurements_and_skip_missing_layers() -> None:
    report = fake_report()
    ratios = compute_ratios(report)
    assert paired_ratio(report["prange_us"]["omp"], "tiny") == pytest.approx(6.0)
    assert ratios["tiny step: omp prange / SpinPool"] == pytest.approx(6.0)
    assert ratios["tiny step: workqueue prange / SpinPool"] is None
    assert ratios["matvec step: fastest prange / SpinPool"] == pytest.approx(6.0)
    assert ratios["barrier round trip, 2 threads (ns)"] == 60.0
    assert set(ratios) == set(TARGETS)


def test_report_shows_every_section_and_marks_unavailable_layers() -> None:
    report = fake_report()
    report["ratios"] = compute_ratios(report)
    text = format_report(report)
    for heading in ("barrier episode", "pool.run(empty kernel)", "step of 300 ops", "idle pool",
                    "asyncio sleep(1 ms) lateness", "target"):
        assert heading in text
    assert "numba prange, tbb | unavailable: libtbb.so.12" in text
    assert "| tiny step: workqueue prange / SpinPool | n/a | >= 100 | ? |" in text
