"""`treadle bench pool [--json PATH] [--quick]`: SpinPool against fork/join alternatives.

Measures, in one run so that ratios are comparable on a noisy shared machine:
  - spin-barrier episode cost with 1..N threads; `pool.run` of an empty kernel, spinning and
    from parked (the wake-up); the CPU an idle pool burns;
  - a step of 300 barrier-separated ops (tiny: pure synchronisation; realistic: 576x576 matvec
    split by rows) with SpinPool, one `pool.run` per op, numba prange under each threading layer
    (each in a subprocess: numba fixes the layer per process), ThreadPoolExecutor, and
    threading.Barrier;
  - asyncio `sleep(1 ms)` lateness while the pool runs steps back to back, pinned and unpinned.

Every figure is a median over repetitions; the JSON keeps p10/p90 as well.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba import njit

from bench.pool_report import TARGETS, compute_ratios, format_report
from bench.pool_steps import (
    MATVEC_OP,
    NUM_OPS,
    OP_KINDS,
    PythonBarrierTeam,
    make_operands,
    step_on_executor,
    step_on_pool,
    step_on_pool_run_per_op,
    step_prange,
    step_serial,
)
from bench.pool_timing import summarize, time_interleaved, time_repeatedly, to_us
from threadpool.affinity import usable_cores
from threadpool.atomics import load_acquire
from threadpool.barrier import barrier_wait
from threadpool.handoff import NUM_PARKED
from threadpool.pool import SpinPool

PRANGE_LAYERS = {  # name: environment for the subprocess
    "workqueue": {"NUMBA_THREADING_LAYER": "workqueue"},
    "omp": {"NUMBA_THREADING_LAYER": "omp"},
    "omp-passive": {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "PASSIVE"},
    "tbb": {"NUMBA_THREADING_LAYER": "tbb"},
}


# ---- the pool's own costs ------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def barrier_episodes(tid: int, nthreads: int, barrier: np.ndarray, num_episodes: int) -> None:
    for _ in range(num_episodes):
        barrier_wait(barrier, tid)


@njit(nogil=True, cache=True)
def empty_kernel(tid: int, nthreads: int, barrier: np.ndarray) -> None:
    pass


@njit(nogil=True, cache=True)
def num_parked_workers(control: np.ndarray) -> int:
    return load_acquire(control, NUM_PARKED)


def wait_until_parked(pool: SpinPool, timeout_s: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while num_parked_workers(pool._state.control) < pool.n_threads - 1 and time.perf_counter() < deadline:
        time.sleep(200e-6)


def measure_barrier_ns(max_threads: int, budget_s: float) -> dict[int, dict[str, float]]:
    """ns per barrier episode, from runs of 20k episodes, for 1..max_threads threads."""
    num_episodes = 20_000
    results = {}
    for num_threads in range(1, max_threads + 1):
        with SpinPool(num_threads) as pool:
            seconds = time_repeatedly(lambda: pool.run(barrier_episodes, num_episodes), budget_s)
        results[num_threads] = {k: v * 1e9 / num_episodes if k != "reps" else v for k, v in seconds.items()}
    return results


def measure_pool_run_us(budget_s: float) -> dict[str, dict[str, float]]:
    """pool.run(empty kernel) back to back (workers spinning) and after they parked."""
    with SpinPool() as pool:
        spinning = time_repeatedly(lambda: pool.run(empty_kernel), budget_s, max_reps=5000)

        def run_from_parked() -> None:
            wait_until_parked(pool)
            start = time.perf_counter()
            pool.run(empty_kernel)
            durations.append(time.perf_counter() - start)

        durations: list[float] = []
        for _ in range(100):
            run_from_parked()
        parked = summarize(durations)
    return {"spinning": to_us(spinning), "from_parked": to_us(parked)}


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_idle_cpu_percent(idle_s: float) -> dict[str, float]:
    """CPU the process burns (% of one core) while a pool sits idle: parking, and never parking."""
    results = {}
    for label, spin_us in (("parks after 100 us", 100.0), ("spins forever", 1e12)):
        with SpinPool(spin_us=spin_us) as pool:
            pool.run(empty_kernel)
            seconds = idle_s if spin_us < 1e6 else min(idle_s, 0.5)
            before = process_cpu_seconds()
            time.sleep(seconds)
            results[label] = 100.0 * (process_cpu_seconds() - before) / seconds
    return results


# ---- steps of 300 ops --------------------------------------------------------------------------------


def measure_steps_in_process(num_threads: int, budget_s: float) -> dict[str, dict[str, dict[str, float]]]:
    """Microseconds per step for every in-process approach, per op kind; checks results agree."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    with ThreadPoolExecutor(num_threads) as executor:
        # Start the executor's threads before the pool pins this thread: they would inherit it.
        list(executor.map(time.sleep, [0.01] * num_threads))
        team = PythonBarrierTeam(num_threads)
        pool = SpinPool(num_threads)
        try:
            approaches: dict[str, Callable[[int, np.ndarray, np.ndarray, int], None]] = {
                "SpinPool (one run, spin barriers)": lambda *a: step_on_pool(pool, *a),
                "SpinPool (one run per op)": lambda *a: step_on_pool_run_per_op(pool, *a),
                "ThreadPoolExecutor (submit per op)": lambda *a: step_on_executor(executor, num_threads, *a),
                "threading.Barrier (persistent threads)": team.step,
                "serial (1 thread, no sync)": step_serial,
            }
            for kind_name, kind in OP_KINDS.items():
                expected = reference_result(kind)
                for name, step in approaches.items():
                    weights, buffers = make_operands(kind)
                    step(kind, weights, buffers, NUM_OPS)
                    check_result(name, buffers, expected)
                # Timed on the same arrays: where data sits in memory moves a matvec by ~10%.
                weights, buffers = make_operands(kind)
                actions = {name: partial(step, kind, weights, buffers, NUM_OPS) for name, step in approaches.items()}
                results[kind_name] = {name: to_us(seconds)
                                      for name, seconds in time_interleaved(actions, budget_s, pause_s=0.01).items()}
        finally:
            pool.close()
            team.close()
    return results


def reference_result(kind: int) -> np.ndarray:
    weights, buffers = make_operands(kind)
    step_serial(kind, weights, buffers, NUM_OPS)
    return buffers[NUM_OPS % 2].copy()


def check_result(approach: str, buffers: np.ndarray, expected: np.ndarray) -> None:
    if not np.allclose(buffers[NUM_OPS % 2], expected, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{approach} computed a different step result than the serial one")


def measure_prange_here(budget_s: float) -> dict[str, Any]:
    """Run inside a subprocess whose threading layer is fixed by its environment: prange steps,
    and SpinPool steps in alternating blocks (paired, for ratios that share the same machine
    conditions). 100 ms pauses between blocks let OpenMP's spinning threads fall asleep, so the
    two never spin against each other."""
    num_threads = numba.get_num_threads()
    results: dict[str, Any] = {"layer": None, "num_threads": num_threads}
    with SpinPool(num_threads) as pool:
        for kind_name, kind in OP_KINDS.items():
            expected = reference_result(kind)
            weights, buffers = make_operands(kind)
            step_prange(kind, weights, buffers, NUM_OPS, num_threads)
            check_result("prange", buffers, expected)
            # Both timed on the same arrays: where data sits in memory moves a matvec by ~10%.
            timed = time_interleaved({
                "prange": partial(step_prange, kind, weights, buffers, NUM_OPS, num_threads),
                "SpinPool": partial(step_on_pool, pool, kind, weights, buffers, NUM_OPS),
            }, 2 * budget_s, pause_s=0.1)
            results[kind_name] = to_us(timed["prange"])
            results[kind_name + " SpinPool (paired)"] = to_us(timed["SpinPool"])
    results["layer"] = numba.threading_layer()
    return results


def measure_prange_layers(num_threads: int, budget_s: float) -> dict[str, dict[str, Any]]:
    """One subprocess per threading layer; a layer that cannot load is reported, not fatal."""
    results: dict[str, dict[str, Any]] = {}
    for layer, layer_env in PRANGE_LAYERS.items():
        env = {**os.environ, **layer_env, "NUMBA_NUM_THREADS": str(num_threads)}
        # pip's `tbb` wheel puts libtbb.so.12 in <venv>/lib, where the loader does not look.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(Path(sys.prefix) / "lib"),
                                                              env.get("LD_LIBRARY_PATH")]))
        command = [sys.executable, "-m", "bench.pool", "--prange-here", "--budget", str(budget_s)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            last_line = (done.stderr.strip().splitlines() or ["exited with " + str(done.returncode)])[-1]
            results[layer] = {"error": last_line}
            continue
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        if measured["layer"] != layer_env["NUMBA_THREADING_LAYER"]:
            measured = {"error": f"numba picked {measured['layer']} instead"}
        results[layer] = measured
    return results


# ---- asyncio lateness while the pool works ---------------------------------------------------------


def measure_loop_lateness(duration_s: float) -> dict[str, float]:
    """Lateness (ms) of `await asyncio.sleep(1 ms)` on an event loop in this thread."""

    async def probe() -> list[float]:
        lateness = []
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append((time.perf_counter() - start - 0.001) * 1e3)
        return lateness

    return summarize(asyncio.run(probe()))


def measure_loop_with_busy_pool(pin: bool | None, duration_s: float) -> dict[str, Any]:
    """Event loop on this thread; an engine thread runs matvec steps back to back on a pool
    (pin=None: no pool at all, the baseline). Returns loop lateness and step times."""
    if pin is None:
        return {"loop_lateness_ms": measure_loop_lateness(duration_s)}
    weights, buffers = make_operands(MATVEC_OP)
    step_times: list[float] = []
    stop = threading.Event()

    def engine() -> None:
        with SpinPool(pin=pin) as pool:
            while not stop.is_set():
                start = time.perf_counter()
                step_on_pool(pool, MATVEC_OP, weights, buffers, NUM_OPS)
                step_times.append(time.perf_counter() - start)

    engine_thread = threading.Thread(target=engine, name="engine")
    engine_thread.start()
    try:
        lateness = measure_loop_lateness(duration_s)
    finally:
        stop.set()
        engine_thread.join()
    return {"loop_lateness_ms": lateness, "step_ms": {k: v * 1e3 if k != "reps" else v
                                                       for k, v in summarize(step_times).items()}}


def machine_description() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "usable_cores": len(usable_cores()), "numba": numba.__version__,
            "python": platform.python_version(), "load_average_before": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench pool", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="shorter timing budgets (noisier)")
    parser.add_argument("--budget", type=float, default=None, help="seconds per measurement")
    parser.add_argument("--prange-here", action="store_true", help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args(argv)
    budget_s = args.budget if args.budget is not None else (0.3 if args.quick else 1.0)
    if args.prange_here:
        print(json.dumps(measure_prange_here(budget_s)))
        return 0

    num_threads = len(usable_cores())
    report: dict[str, Any] = {"machine": machine_description(), "num_ops": NUM_OPS, "num_threads": num_threads}
    report["barrier_ns"] = measure_barrier_ns(num_threads, budget_s)
    report["pool_run_us"] = measure_pool_run_us(budget_s)
    report["idle_cpu_percent"] = measure_idle_cpu_percent(1.0 if args.quick else 2.0)
    report["steps_us"] = measure_steps_in_process(num_threads, budget_s)
    report["prange_us"] = measure_prange_layers(num_threads, budget_s)
    loop_s = 1.0 if args.quick else 3.0
    report["asyncio"] = {
        "no pool (baseline)": measure_loop_with_busy_pool(None, loop_s),
        "pool busy, workers pinned": measure_loop_with_busy_pool(True, loop_s),
        "pool busy, workers unpinned": measure_loop_with_busy_pool(False, loop_s),
    }
    report["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report["ratios"] = compute_ratios(report)
    report["targets"] = {name: {"relation": rel, "wanted": wanted, "measured": report["ratios"][name]}
                         for name, (rel, wanted) in TARGETS.items()}
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
