"""SpinPool and the spin barrier: correctness, errors, lifetime, parking. No speed is asserted."""

from __future__ import annotations

import gc
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from threadpool import BarrierAborted, SpinPool, barrier_wait, make_barrier
from threadpool.atomics import WORDS_PER_CACHE_LINE, cache_aligned_zeros, cpu_pause, fetch_add, load_acquire
from threadpool.handoff import NUM_PARKED

pytestmark = pytest.mark.timeout(120)

NUM_CORES = len(os.sched_getaffinity(0))
TWO_CORES = NUM_CORES >= 2


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


_RELEASE, _NUM_ENTERED, _NUM_EXITED = 0, 8, 16  # words of workers_wait_for_release, one cache line each


@njit(nogil=True, cache=True)
def workers_wait_for_release(tid: int, nthreads: int, barrier: np.ndarray, words: np.ndarray) -> None:
    """Thread 0 returns at once; workers count their entry in words[_NUM_ENTERED], spin until
    words[_RELEASE] != 0, then count their exit in words[_NUM_EXITED]. words: int64 (24,), cache-aligned."""
    if tid != 0:
        fetch_add(words, _NUM_ENTERED, 1)
        while load_acquire(words, _RELEASE) == 0:  # acquire: re-read every spin
            cpu_pause()
        fetch_add(words, _NUM_EXITED, 1)  # acq_rel RMW: the exit count is exact


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
    episodes = 5_000 if num_threads <= NUM_CORES else 50
    slots = np.zeros(num_threads * 8, dtype=np.int64)
    num_wrong = np.zeros(num_threads, dtype=np.int64)
    with SpinPool(num_threads, oversubscribe=num_threads > NUM_CORES) as pool:
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


class Interrupted(Exception):
    """What the test's signal handler raises in thread 0, like a KeyboardInterrupt from SIGINT."""


@pytest.mark.parametrize("num_signals", [1, 2])
def test_an_interrupt_while_thread_zero_waits_returns_only_after_every_worker_left_the_kernel(
    num_signals: int,
) -> None:
    """A signal handler raising in thread 0 (SIGINT's KeyboardInterrupt does the same) while it
    waits for workers must not return from run with workers still in the kernel, writing the
    caller's arrays; a second signal during that wait must not be a way out either."""
    words = cache_aligned_zeros(24)
    main_thread = threading.get_ident()

    def raise_interrupted(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signum}")

    def interrupt_then_release() -> None:
        while words[_NUM_ENTERED] == 0:  # the worker is in the kernel: thread 0 is inside run
            time.sleep(0.001)
        for _ in range(num_signals):
            time.sleep(0.2)
            signal.pthread_kill(main_thread, signal.SIGUSR1)
        time.sleep(0.3)
        words[_RELEASE] = 1  # the worker may leave the kernel

    previous_handler = signal.signal(signal.SIGUSR1, raise_interrupted)
    driver = threading.Thread(target=interrupt_then_release)
    try:
        with SpinPool(2) as pool:
            pool.run(do_nothing)  # the pool's helpers are loaded before the driver starts
            driver.start()
            with pytest.raises(Interrupted, match="signal") as raised:
                pool.run(workers_wait_for_release, words)
            num_exited_at_return = int(words[_NUM_EXITED])
            assert num_exited_at_return == 1, "run returned with a worker still in the kernel"
            num_ignored = sum("arrived while waiting for the workers" in note
                              for note in getattr(raised.value, "__notes__", []))
            assert num_ignored == num_signals - 1
            pool.run(workers_wait_for_release, words)  # the pool is still usable (the release stays set)
            assert words[_NUM_EXITED] == 2
    finally:
        if driver.is_alive():
            driver.join()
        signal.signal(signal.SIGUSR1, previous_handler)


# A pool whose worker died must make run() raise, not spin forever. Run in a subprocess, where a
# hang is a timeout rather than a stuck test session (thread 0 spins in nopython code, which no
# signal reaches) and where a vanished OS thread cannot upset the rest of the suite.
DEAD_WORKER_SCRIPT = textwrap.dedent(
    """
    import ctypes, os, sys
    import numpy as np
    from threadpool import SpinPool
    from tests.test_threadpool_pool import add_tid_plus_one, do_nothing, wait_until_parked, worker_threads

    class WorkerKilled(Exception):
        pass

    libc_syscall = ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value
    exit_this_thread = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long)(libc_syscall)
    SYS_EXIT = 60  # x86-64: ends the calling OS thread only (exit_group ends the process)

    from numba import njit

    @njit(nogil=True)
    def worker_os_thread_exits(tid, nthreads, barrier):
        if tid != 0:
            exit_this_thread(SYS_EXIT, 0)

    how = sys.argv[1]
    pool = SpinPool(2, spin_us=0)
    totals = np.zeros(2, dtype=np.int64)
    pool.run(add_tid_plus_one, totals)
    if how == "exception":  # raised in the parked worker when it wakes, outside any kernel
        assert wait_until_parked(pool, 1)
        (worker,) = worker_threads()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(WorkerKilled))
        kernel = add_tid_plus_one  # thread 0 waits for the dead worker at the kernel's barrier
        args = (totals,)
    else:
        worker_os_thread_exits(0, 1, None)  # compile before the run
        kernel = worker_os_thread_exits  # thread 0 waits for the worker to report the run finished
        args = ()
    for attempt in ("first", "next"):
        try:
            pool.run(kernel, *args)
            print(attempt, "run returned", flush=True)
        except Exception as exc:
            print(attempt, "run raised", type(exc).__name__, exc, flush=True)
    pool.close()
    print("closed", flush=True)
    os._exit(0)
    """
)


@pytest.mark.parametrize("how", ["exception", "os_thread_exit"])
def test_a_dead_worker_makes_run_raise_instead_of_spinning_forever(how: str, tmp_path: Path) -> None:
    """A worker ended by an exception outside its kernel, or whose OS thread vanished mid-kernel:
    run raises BrokenPool naming the worker, later runs are refused, close still returns."""
    if how == "os_thread_exit" and os.uname().machine != "x86_64":
        pytest.skip("the test's SYS_exit number is x86-64's")
    output = tmp_path / "stdout"
    with output.open("w") as stdout:
        try:
            result = subprocess.run([sys.executable, "-c", DEAD_WORKER_SCRIPT, how], stdout=stdout,
                                    stderr=subprocess.PIPE, text=True, timeout=60, check=False,
                                    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        except subprocess.TimeoutExpired:
            pytest.fail(f"run or close hung with a dead worker; its output: {output.read_text()!r}")
    lines = output.read_text().splitlines()
    assert result.returncode == 0, result.stderr
    assert len(lines) == 3, lines + [result.stderr]
    assert lines[0].startswith("first run raised BrokenPool") and "worker thread 1" in lines[0]
    assert lines[1].startswith("next run raised BrokenPool")
    assert lines[2] == "closed"


def test_more_threads_than_usable_cores_are_refused_unless_asked_for() -> None:
    threads_before = set(threading.enumerate())
    with pytest.raises(ValueError, match="time slice") as refused:
        SpinPool(NUM_CORES + 1)
    assert f"{NUM_CORES} usable core" in str(refused.value) and "oversubscribe=True" in str(refused.value)
    with pytest.raises(ValueError, match="time slice"):
        SpinPool(2, cores=[min(os.sched_getaffinity(0))] * 2)  # two threads pinned to one core
    assert set(threading.enumerate()) == threads_before  # refused before starting any worker
    with SpinPool(NUM_CORES + 1, pin=False, oversubscribe=True) as pool:
        pool.run(add_tid_plus_one, totals := np.zeros(NUM_CORES + 1, dtype=np.int64))
    assert totals.tolist() == list(range(1, NUM_CORES + 2))


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
    pool = SpinPool(3, pin=False, oversubscribe=True)
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
