"""SpinPool and the spin barrier: correctness, errors, lifetime, parking. No speed is asserted."""

from __future__ import annotations

import gc
import os
import resource
import threading
import time

import numpy as np
import pytest
from numba import njit

from threadpool import BarrierAborted, SpinPool, barrier_wait, make_barrier
from threadpool.atomics import WORDS_PER_CACHE_LINE, load_acquire
from threadpool.handoff import NUM_PARKED

pytestmark = pytest.mark.timeout(120)

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def worker_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("SpinPool-worker")]


# ---- kernels -------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def record_thread_ids(tid: int, nthreads: int, barrier: np.ndarray, seen: np.ndarray) -> None:
    """seen: int64 (nthreads, 2), row tid = (tid, nthreads)."""
    seen[tid, 0] = tid
    seen[tid, 1] = nthreads


@njit(nogil=True, cache=True)
def exchange_through_barrier(tid: int, nthreads: int, barrier: np.ndarray, slots: np.ndarray,
                             episodes: int, num_wrong: np.ndarray) -> None:
    """Each episode: write our slot, barrier, check everyone's slot, barrier (before overwriting).

    slots: int64 (nthreads * 8,), one cache line per thread; num_wrong: int64 (nthreads,).
    """
    for episode in range(1, episodes + 1):
        slots[tid * 8] = episode * 1000 + tid
        barrier_wait(barrier, tid)
        for other in range(nthreads):
            if slots[other * 8] != episode * 1000 + other:
                num_wrong[tid] += 1
        barrier_wait(barrier, tid)


@njit(nogil=True, cache=True)
def matvec_rows(tid: int, nthreads: int, barrier: np.ndarray, weights: np.ndarray, x: np.ndarray,
                y: np.ndarray, num_layers: int) -> None:
    """num_layers times y = tanh(weights @ x); x = y, rows split across threads, barrier between.

    weights: float32 (n, n); x, y: float32 (n,).
    """
    num_rows = weights.shape[0]
    rows_per_thread = (num_rows + nthreads - 1) // nthreads
    first, last = tid * rows_per_thread, min(num_rows, (tid + 1) * rows_per_thread)
    for _ in range(num_layers):
        for row in range(first, last):
            total = np.float32(0.0)
            for col in range(x.size):
                total += weights[row, col] * x[col]
            y[row] = np.tanh(total)
        barrier_wait(barrier, tid)
        for row in range(first, last):
            x[row] = y[row]
        barrier_wait(barrier, tid)


@njit(nogil=True, cache=True, boundscheck=True)
def index_out_of_bounds_on_last_thread(tid: int, nthreads: int, barrier: np.ndarray,
                                       values: np.ndarray) -> None:
    """values: int64 (k,). The last thread reads past the end, before the first barrier."""
    if tid == nthreads - 1:
        values[0] = values[values.size + 5]
    barrier_wait(barrier, tid)
    barrier_wait(barrier, tid)


@njit(nogil=True, cache=True)
def last_thread_skips_a_barrier(tid: int, nthreads: int, barrier: np.ndarray) -> None:
    barrier_wait(barrier, tid)
    if tid != nthreads - 1:
        barrier_wait(barrier, tid)


@njit(nogil=True, cache=True)
def add_tid_plus_one(tid: int, nthreads: int, barrier: np.ndarray, totals: np.ndarray) -> None:
    """totals: int64 (nthreads,), each thread owns its entry."""
    totals[tid] += tid + 1
    barrier_wait(barrier, tid)


@njit(nogil=True, cache=True, boundscheck=True)
def add_scaled_tid_or_fail(tid: int, nthreads: int, barrier: np.ndarray, totals: np.ndarray, scale: int,
                           failing_tid: np.ndarray) -> None:
    """totals[tid] += scale * (tid + 1); the thread named in failing_tid[0] indexes out of bounds."""
    totals[tid + (totals.size if tid == failing_tid[0] else 0)] += scale * (tid + 1)
    barrier_wait(barrier, tid)


@njit(nogil=True, cache=True)
def do_nothing(tid: int, nthreads: int, barrier: np.ndarray) -> None:
    pass


# ---- the barrier ---------------------------------------------------------------------------------


def test_make_barrier_gives_each_thread_its_own_aligned_cache_line() -> None:
    barrier = make_barrier(3)
    assert barrier.shape == ((1 + 3) * WORDS_PER_CACHE_LINE,)
    assert barrier.ctypes.data % 64 == 0
    assert barrier[0] == 3 and not barrier[1:].any()
    with pytest.raises(ValueError):
        make_barrier(0)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_barrier_stress_every_thread_sees_every_write_of_the_episode(num_threads: int) -> None:
    # 3 threads spinning on 2 cores is slow (a time slice per episode), so fewer episodes.
    episodes = 5_000 if num_threads <= len(os.sched_getaffinity(0)) else 50
    slots = np.zeros(num_threads * 8, dtype=np.int64)
    num_wrong = np.zeros(num_threads, dtype=np.int64)
    with SpinPool(num_threads) as pool:
        pool.run(exchange_through_barrier, slots, episodes, num_wrong)
    assert num_wrong.tolist() == [0] * num_threads
    assert slots[::8].tolist() == [episodes * 1000 + tid for tid in range(num_threads)]


# ---- running kernels -----------------------------------------------------------------------------


def test_single_thread_pool_runs_on_the_caller_and_starts_no_thread() -> None:
    threads_before = set(threading.enumerate())
    with SpinPool(1) as pool:
        assert set(threading.enumerate()) == threads_before
        seen = np.full((1, 2), -1, dtype=np.int64)
        pool.run(record_thread_ids, seen)
        pool.run(add_tid_plus_one, totals := np.zeros(1, dtype=np.int64))
    assert pool.n_threads == 1
    assert seen.tolist() == [[0, 1]]
    assert totals.tolist() == [1]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_every_thread_runs_the_kernel_once_with_its_own_tid(num_threads: int) -> None:
    with SpinPool(num_threads) as pool:
        seen = np.full((num_threads, 2), -1, dtype=np.int64)
        pool.run(record_thread_ids, seen)
        totals = np.zeros(num_threads, dtype=np.int64)
        for _ in range(100):
            pool.run(add_tid_plus_one, totals)
    assert seen.tolist() == [[tid, num_threads] for tid in range(num_threads)]
    assert totals.tolist() == [100 * (tid + 1) for tid in range(num_threads)]


def test_workers_pick_up_new_arguments_between_runs_of_the_same_kernel() -> None:
    """Workers serve repeated runs of one task from nopython; new arrays or scalars must reach them."""
    first, second = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    no_failure = np.array([-1])
    with SpinPool(2) as pool:
        for run in range(200):
            target = first if run % 3 else second
            pool.run(add_scaled_tid_or_fail, target, 1 + run % 2, no_failure)
    expected_first = sum(1 + run % 2 for run in range(200) if run % 3)
    expected_second = sum(1 + run % 2 for run in range(200) if not run % 3)
    assert first.tolist() == [expected_first, 2 * expected_first]
    assert second.tolist() == [expected_second, 2 * expected_second]


def test_a_failure_in_a_later_run_of_the_same_task_is_reported_and_survived() -> None:
    totals = np.zeros(2, dtype=np.int64)
    failing_tid = np.array([-1])
    with SpinPool(2) as pool:
        for run in range(50):
            failing_tid[0] = 1 if run == 30 else -1  # same array object: the task does not change
            if run == 30:
                with pytest.raises(IndexError):
                    pool.run(add_scaled_tid_or_fail, totals, 1, failing_tid)
            else:
                pool.run(add_scaled_tid_or_fail, totals, 1, failing_tid)
    assert totals.tolist() == [50, 49 * 2]  # thread 1 skipped its add in the failed run


def test_caller_is_thread_zero() -> None:
    observed: dict[int, int] = {}

    def note_thread(tid: int, nthreads: int, barrier: np.ndarray) -> None:  # a Python kernel
        observed[tid] = threading.get_ident()

    with SpinPool(2) as pool:
        pool.run(note_thread)
    assert observed[0] == threading.get_ident()
    assert observed[1] != threading.get_ident()


@pytest.mark.parametrize("num_threads", [1, 2])
def test_row_split_matvec_layers_equal_numpy(num_threads: int) -> None:
    rng = np.random.default_rng(0)
    size, num_layers = 96, 5
    weights = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    x = rng.standard_normal(size).astype(np.float32)
    expected = x.copy()
    for _ in range(num_layers):
        expected = np.tanh(weights @ expected)
    y = np.zeros(size, dtype=np.float32)
    with SpinPool(num_threads) as pool:
        pool.run(matvec_rows, weights, x, y, num_layers)
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-6)


# ---- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_threads", [1, 2])
def test_index_error_in_a_kernel_reaches_the_caller_and_the_pool_stays_usable(num_threads: int) -> None:
    with SpinPool(num_threads) as pool:
        with pytest.raises(IndexError) as raised:
            pool.run(index_out_of_bounds_on_last_thread, np.zeros(3, dtype=np.int64))
        if num_threads > 1:
            assert any("thread 1 of 2" in note for note in raised.value.__notes__)
        totals = np.zeros(num_threads, dtype=np.int64)
        pool.run(add_tid_plus_one, totals)
        assert totals.tolist() == [tid + 1 for tid in range(num_threads)]


@pytest.mark.parametrize("failing_tid", [0, 1])
def test_python_exception_in_any_thread_reaches_the_caller(failing_tid: int) -> None:
    def fail_on_one_thread(tid: int, nthreads: int, barrier: np.ndarray) -> None:
        if tid == failing_tid:
            raise ValueError(f"thread {tid} failed")
        barrier_wait(barrier, tid)  # the other thread must not wait here forever

    with SpinPool(2) as pool:
        with pytest.raises(ValueError, match=f"thread {failing_tid} failed"):
            pool.run(fail_on_one_thread)
        pool.run(add_tid_plus_one, totals := np.zeros(2, dtype=np.int64))
    assert totals.tolist() == [1, 2]


def test_threads_passing_different_numbers_of_barriers_fail_instead_of_hanging() -> None:
    with SpinPool(2) as pool:
        with pytest.raises(BarrierAborted, match=r"different numbers of barriers: \[2, 1\]"):
            pool.run(last_thread_skips_a_barrier)
        pool.run(add_tid_plus_one, totals := np.zeros(2, dtype=np.int64))
    assert totals.tolist() == [1, 2]


def test_run_from_inside_a_kernel_fails_clearly() -> None:
    with SpinPool(2) as pool:

        def nested(tid: int, nthreads: int, barrier: np.ndarray) -> None:
            pool.run(do_nothing)

        with pytest.raises(RuntimeError, match="inside one of its own kernels"):
            pool.run(nested)


# ---- concurrency, lifetime ------------------------------------------------------------------------


def test_concurrent_runs_from_two_python_threads_are_serialised() -> None:
    runs_per_caller = 500
    totals = np.zeros(2, dtype=np.int64)
    with SpinPool(2) as pool:
        pool.run(add_tid_plus_one, np.zeros(2, dtype=np.int64))

        def run_many() -> None:
            for _ in range(runs_per_caller):
                pool.run(add_tid_plus_one, totals)

        callers = [threading.Thread(target=run_many) for _ in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    # Two overlapping runs would race on totals (plain +=) and on the barrier.
    assert totals.tolist() == [2 * runs_per_caller * 1, 2 * runs_per_caller * 2]


def test_close_joins_every_worker_and_later_runs_fail() -> None:
    threads_before = set(threading.enumerate())
    pool = SpinPool(3, pin=False)
    assert len(worker_threads()) == 2
    pool.close()
    pool.close()  # idempotent
    assert set(threading.enumerate()) == threads_before
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(do_nothing)


def test_context_manager_joins_workers_even_after_an_error() -> None:
    threads_before = set(threading.enumerate())
    with pytest.raises(KeyError), SpinPool(2) as pool:
        pool.run(do_nothing)
        raise KeyError("boom")
    assert set(threading.enumerate()) == threads_before


def test_a_dropped_pool_stops_its_workers() -> None:
    pool = SpinPool(2)
    pool.run(do_nothing)
    workers = worker_threads()
    assert workers
    del pool
    gc.collect()
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.is_alive()


@pytest.mark.skipif(not TWO_CORES, reason="needs two usable cores")
def test_pinned_pool_pins_workers_and_the_caller_until_close() -> None:
    cores = sorted(os.sched_getaffinity(0))
    affinity_during_run: dict[int, set[int]] = {}

    def note_affinity(tid: int, nthreads: int, barrier: np.ndarray) -> None:  # a Python kernel
        affinity_during_run[tid] = os.sched_getaffinity(0)

    with SpinPool(2) as pool:
        pool.run(note_affinity)
        (worker,) = worker_threads()
        assert os.sched_getaffinity(worker.native_id) == {cores[1]}
        assert os.sched_getaffinity(0) == {cores[0]}  # the caller stays pinned between runs
    assert affinity_during_run == {0: {cores[0]}, 1: {cores[1]}}
    assert os.sched_getaffinity(0) == set(cores)  # and gets its cores back at close()

    with SpinPool(2, pin=False) as pool:
        pool.run(note_affinity)
        (worker,) = worker_threads()
        assert os.sched_getaffinity(worker.native_id) == set(cores)
    assert affinity_during_run == {0: set(cores), 1: set(cores)}


# ---- spinning, parking, idle CPU ------------------------------------------------------------------


def wait_until_parked(pool: SpinPool, num_workers: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if read_num_parked(pool._state.control) == num_workers:
            return True
        time.sleep(0.001)
    return False


@njit(nogil=True, cache=True)
def read_num_parked(control: np.ndarray) -> int:
    return load_acquire(control, NUM_PARKED)


def test_idle_workers_park_and_wake_for_the_next_run() -> None:
    with SpinPool(2, spin_us=50) as pool:
        totals = np.zeros(2, dtype=np.int64)
        for _ in range(5):
            pool.run(add_tid_plus_one, totals)
            assert wait_until_parked(pool, 1)
        assert read_num_parked(pool._state.control) == 1
    assert totals.tolist() == [5, 10]


def test_parking_at_once_never_loses_a_wake_up() -> None:
    """spin_us=0: every run races the kick-off against a worker going to sleep. A lost wake-up
    would hang here (the timeout mark turns that into a failure)."""
    runs = 3000
    totals = np.zeros(2, dtype=np.int64)
    with SpinPool(2, spin_us=0) as pool:
        for _ in range(runs):
            pool.run(add_tid_plus_one, totals)
    assert totals.tolist() == [runs, 2 * runs]


def test_idle_pool_uses_almost_no_cpu() -> None:
    with SpinPool() as pool:
        pool.run(do_nothing)
        assert wait_until_parked(pool, pool.n_threads - 1)
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(2.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_seconds < 0.4  # < 20% of one core; a spinning worker would use ~2.0


@njit(cache=True)
def holds_the_gil(tid: int, nthreads: int, barrier: np.ndarray) -> None:
    barrier_wait(barrier, tid)


def test_kernel_without_nogil_is_refused_instead_of_deadlocking() -> None:
    with SpinPool(2) as pool:
        with pytest.raises(ValueError, match="nogil=True"):
            pool.run(holds_the_gil)
        pool.run(do_nothing)
