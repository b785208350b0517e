"""How `treadle bench pool` times: repetitions to a budget, or several actions in alternating blocks so
that a drifting machine shifts them all alike; each summarized as median, p10/p90/p99 and max."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np


def time_repeatedly(action: Callable[[], object], budget_s: float, min_reps: int = 5,
                    max_reps: int = 2000) -> dict[str, float]:
    """Run `action` once to warm up, then until `budget_s` or `max_reps`; seconds per call."""
    action()
    durations: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(durations) < max_reps and (len(durations) < min_reps or time.perf_counter() < deadline):
        start = time.perf_counter()
        action()
        durations.append(time.perf_counter() - start)
    return summarize(durations)


def time_interleaved(actions: Mapping[str, Callable[[], object]], budget_s: float, rounds: int = 4,
                     pause_s: float = 0.0, max_reps_per_block: int = 200) -> dict[str, dict[str, float]]:
    """Time several actions in alternating blocks, `rounds` blocks each, so that a machine whose
    speed drifts (other tenants) shifts them all alike; seconds per call for each action.
    `pause_s` before each block lets threads of the previous action fall asleep."""
    samples: dict[str, list[float]] = {name: [] for name in actions}
    for action in actions.values():
        action()  # warm-up: compile, load the cache, fault in pages
    for _ in range(rounds):
        for name, action in actions.items():
            time.sleep(pause_s)
            block = samples[name]
            block_start, reps = time.perf_counter(), 0
            while reps < 3 or (time.perf_counter() - block_start < budget_s / rounds and reps < max_reps_per_block):
                start = time.perf_counter()
                action()
                block.append(time.perf_counter() - start)
                reps += 1
    return {name: summarize(values) for name, values in samples.items()}


def summarize(samples: list[float]) -> dict[str, float]:
    values = np.asarray(samples)
    return {
        "median": float(np.median(values)),
        "p10": float(np.percentile(values, 10)),
        "p90": float(np.percentile(values, 90)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
        "reps": len(samples),
    }


def to_us(seconds: dict[str, float]) -> dict[str, float]:
    return {k: v * 1e6 if k != "reps" else v for k, v in seconds.items()}
