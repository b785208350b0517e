"""SpinPool: persistent, pinned worker threads that run numba kernels SPMD, caller included.

    with SpinPool() as pool:                      # n_threads = usable cores
        pool.run(kernel, x, y)                    # kernel(tid, nthreads, barrier, x, y) on every thread

The calling thread is thread 0 and does its share: with n_threads=2 there is exactly one worker.
That matters on a 2-core machine, where a caller waiting on two spinning workers is three busy
threads on two cores and costs a scheduler time slice (milliseconds) per run.

A run: thread 0 publishes the task and bumps the epoch (`start_run`), runs its own share, leaves
the barrier, then waits until every worker reports the epoch finished (`finish_share_and_wait`).
Workers wait for the next epoch by spinning for `spin_us`, then parking on a futex
(`handoff.wait_for_work`), so an idle pool uses no CPU. Inside the kernel threads meet at
`barrier_wait(barrier, tid)`. This module is thread 0's side; `threadpool.workers` the workers'.

The GIL: a worker that needs the GIL while another thread holds it sleeps on a condition variable
and is woken microseconds (or, against a busy event loop, up to a switch interval) later. So
workers stay out of Python: for a numba kernel, a worker calls it from the nopython trampoline
`serve_task`, which goes on serving the following runs of the *same task* (same kernel, same
argument objects) without returning to Python. Only a new task or a park needs the GIL. Plain
Python callables also work as kernels (one thread at a time, through the GIL): handy in tests.

Errors: every thread catches what its kernel raises and leaves the barrier, which makes threads
still waiting for it raise `BarrierAborted`. `run` waits for all threads, then re-raises the root
cause (the first exception that is not a `BarrierAborted`), or, if threads only disagreed on how
many barriers to pass, a `BarrierAborted` naming the counts. The pool stays usable. A kernel that
never returns still hangs `run`: nothing can stop a thread inside nopython code.

`run` never returns, not even by an exception, while a worker may still be inside the kernel
writing the caller's arrays (vLLM and ggml never hand buffers back early either): thread 0
interrupted by a KeyboardInterrupt, or by whatever a signal handler raises, leaves the barrier
(workers waiting for it abort), waits for every worker, then re-raises; interrupts that arrive
meanwhile are noted on the first. A worker whose thread ended outside a kernel (an exception
escaped its loop, or its OS thread vanished) breaks the pool: `run` raises `BrokenPool` instead
of waiting for it forever, and so do later runs. (A worker that vanishes at the OS level while
the others wait for it at a barrier still hangs them: nothing reaches a nopython spin.)
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import numpy as np
from numba import njit

from threadpool.affinity import pin_calling_thread, pin_thread, set_thread_affinity, usable_cores
from threadpool.atomics import store_release
from threadpool.barrier import (
    BarrierAborted,
    arrival_counts,
    make_barrier,
    mark_departed,
    mark_gone,
    reset_barrier,
)
from threadpool.handoff import (
    EPOCH,
    SHUTDOWN,
    TASK,
    announce_parking,
    epoch_futex_address,
    futex_wake_all,
    kick_off,
    leave_parking,
    load_acquire_from_python,
    make_control,
    nanoseconds_per_spin,
    report_finished,
    request_shutdown,
    wait_for_work,
    wait_for_workers,
)
from threadpool.workers import (
    Kernel,
    PoolState,
    Task,
    finish_share_and_spin,
    os_thread_exists,
    record_error,
    worker_main,
)

DEFAULT_SPIN_US = 100.0
# When workers are still busy after thread 0 spun for spin_us, it polls this often instead,
# and looks for workers whose OS thread vanished every this many polls (~10 ms).
_SLOW_WAIT_POLL_SECONDS = 50e-6
_POLLS_PER_LIVENESS_CHECK = 128

class BrokenPool(RuntimeError):
    """A worker thread died (an exception escaped its loop, outside any kernel, or its OS thread
    vanished): the pool cannot run kernels any more. Close it and start a new one."""


class SpinPool:
    """A fixed team of `n_threads` threads (the caller + n_threads - 1 workers) for SPMD kernels.

    n_threads: default, the number of usable cores (`os.sched_getaffinity`). More than the cores
               is refused unless `oversubscribe=True`: spinning threads that share a core wait
               out each other's time slices, so each barrier would cost milliseconds.
    pin:       pin worker tid to `cores[tid]`, and a thread calling `run` to `cores[0]` from its
               first run until `close()`, which restores its affinity. Unpinned, a loaded
               machine's scheduler may stack thread 0 and a worker on one core, where a spinning
               thread waits a whole time slice for the one it spins on. (Threads the caller
               starts meanwhile inherit its pinning.)
    cores:     the cores to use, default the usable ones in ascending order.
    spin_us:   how long an idle worker spins before parking; 0 parks at once.
    oversubscribe: allow more threads than cores (correctness tests; never fast).
    """

    def __init__(
        self,
        n_threads: int | None = None,
        pin: bool = True,
        cores: Sequence[int] | None = None,
        spin_us: float = DEFAULT_SPIN_US,
        oversubscribe: bool = False,
    ) -> None:
        cores = list(cores) if cores is not None else usable_cores()
        n_threads = len(cores) if n_threads is None else n_threads
        if n_threads < 1 or not cores:
            raise ValueError(f"need at least one thread and one core, got {n_threads=}, {cores=}")
        num_cores = len(set(cores))
        if n_threads > num_cores and not oversubscribe:
            raise ValueError(
                f"n_threads={n_threads} is more than the {num_cores} usable core(s) {sorted(set(cores))}: "
                "threads that spin wait out each other's scheduler time slice when they share a core, so "
                "every barrier would cost a time slice (milliseconds) instead of ~0.1 us. Use at most "
                f"{num_cores} threads, or pass oversubscribe=True to accept that (e.g. in a correctness test)."
            )
        if spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        self.n_threads = n_threads
        self.spin_us = spin_us
        self._caller_core = cores[0] if pin and n_threads > 1 else None
        self._state = PoolState(n_threads, max_spins=int(spin_us * 1000 / nanoseconds_per_spin()))
        _compile_helpers()
        threads = _start_workers(self._state)
        # Registered before pinning, so that a bad core id still stops the started workers.
        self._finalizer = weakref.finalize(self, _stop_workers, self._state, threads)
        if pin:
            try:
                for tid, thread in enumerate(threads, start=1):
                    assert thread.native_id is not None  # set once start() returned
                    pin_thread(thread.native_id, cores[tid % len(cores)])
            except OSError:
                self.close()
                raise

    def run(self, kernel: Kernel, *args: Any) -> None:
        """Run `kernel(tid, n_threads, barrier, *args)` on every thread (this one is tid 0) and
        return when all have finished; re-raises what a thread raised. Calls from several Python
        threads at once run one after another."""
        state = self._state
        if threading.get_ident() in (state.running_thread, *state.worker_idents):
            raise RuntimeError("SpinPool.run called from inside one of its own kernels")
        with state.run_lock:
            if state.is_closed:
                raise RuntimeError("SpinPool is closed")
            if state.dead_workers:
                raise _broken_pool_error(state)
            state.running_thread = threading.get_ident()
            if self._caller_core is not None:
                _pin_caller(state, self._caller_core)
            try:
                _run_locked(state, kernel, args)
            finally:
                state.running_thread = None

    def close(self) -> None:
        """Stop and join every worker. Idempotent; `run` fails afterwards."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = " closed" if self._state.is_closed else ""
        return f"<SpinPool n_threads={self.n_threads} spin_us={self.spin_us}{closed}>"


# ---- thread 0: one run -----------------------------------------------------------------------------


def _pin_caller(state: PoolState, core: int) -> None:
    """Pin the calling thread on its first run (a dict lookup afterwards, no syscall)."""
    caller = threading.current_thread()
    if caller not in state.pinned_callers:
        state.pinned_callers[caller] = pin_calling_thread(core)


def _unpin_callers(state: PoolState) -> None:
    for caller, previous_cores in state.pinned_callers.items():
        if previous_cores is not None and caller.is_alive() and caller.native_id is not None:
            set_thread_affinity(caller.native_id, previous_cores)
    state.pinned_callers.clear()


def _run_locked(state: PoolState, kernel: Kernel, args: tuple[Any, ...]) -> None:
    if state.num_threads == 1:
        reset_barrier(state.barrier)
        kernel(0, 1, state.barrier, *args)
        return
    state.task = _task_for(state, kernel, args)
    state.errors = [None] * state.num_threads
    try:
        state.epoch += 1
        if start_run(state.barrier, state.control, state.task.task_id, state.epoch) > 0:
            futex_wake_all(epoch_futex_address(state.control))
        if state.dead_workers:  # one died since run() looked, and start_run just reset its line
            _bury_dead_workers(state)
        try:
            kernel(0, state.num_threads, state.barrier, *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the workers are done
            record_error(state, 0, exc)
        _finish_run(state)
    except BaseException as interrupt:  # a signal handler raised in thread 0 outside its kernel
        _wait_out_workers(state, interrupt)
        raise
    if state.dead_workers:
        raise _broken_pool_error(state)
    error = _root_cause(state.errors, state.barrier)
    if error is not None:
        raise error


def _wait_out_workers(state: PoolState, interrupt: BaseException) -> None:
    """Thread 0 was interrupted between kick-off and the end of the run, so workers may still be
    in the kernel, writing the caller's arrays. Leave the barrier (workers waiting for thread 0
    abort), wake any parked worker, and wait for all of them; further interrupts meanwhile are
    noted on the first, not a way out."""
    while True:
        try:
            # The epoch the workers really saw: the interrupt may have come before the kick-off.
            state.epoch = load_acquire_from_python(state.control, EPOCH)
            futex_wake_all(epoch_futex_address(state.control))
            _finish_run(state)
            return
        except BaseException as another:  # noqa: BLE001 - the first interrupt is re-raised
            interrupt.add_note(f"SpinPool.run: {another!r} arrived while waiting for the workers; ignored")


def _task_for(state: PoolState, kernel: Kernel, args: tuple[Any, ...]) -> Task:
    """The previous task if nothing changed (workers keep serving it without the GIL), else a
    new one."""
    previous = state.task
    if previous is not None and previous.is_same(kernel, args):
        return previous
    task = Task(kernel, args, 1 if previous is None else previous.task_id + 1)
    if task.is_numba and not getattr(kernel, "targetoptions", {}).get("nogil"):
        # Thread 0 would hold the GIL inside the kernel while a worker needs it to start: deadlock.
        raise ValueError(f"SpinPool kernels must be compiled with nogil=True: {kernel!r}")
    return task


@njit(nogil=True, cache=True, _nrt=False)
def start_run(barrier: np.ndarray, control: np.ndarray, task_id: int, epoch: int) -> int:
    """Thread 0: reset the barrier, publish the task id and kick off run `epoch`; returns the
    number of parked workers to wake."""
    reset_barrier(barrier)  # the workers finished the previous run: no one is in the barrier
    store_release(control, TASK, task_id)  # release; kick_off's release store covers it too
    return kick_off(control, epoch)


@njit(nogil=True, cache=True, _nrt=False)
def finish_share_and_wait(barrier: np.ndarray, control: np.ndarray, epoch: int, max_spins: int) -> bool:
    """Thread 0, after its share: leave the barrier, then spin until all workers finished."""
    mark_departed(barrier, 0)
    return wait_for_workers(control, barrier[0] - 1, epoch, max_spins)


def _finish_run(state: PoolState) -> None:
    """Thread 0: leave the barrier and wait until every worker finished the current epoch; spin
    for up to spin_us, then poll gently (a long, unbalanced kernel should not burn a core),
    counting dead workers as finished."""
    max_spins = max(state.max_spins, 1)
    if finish_share_and_wait(state.barrier, state.control, state.epoch, max_spins):
        return
    num_polls = 0
    while not wait_for_workers(state.control, state.num_threads - 1, state.epoch, max_spins):
        time.sleep(_SLOW_WAIT_POLL_SECONDS)
        num_polls += 1
        if num_polls % _POLLS_PER_LIVENESS_CHECK == 0:
            _find_vanished_workers(state)
        if state.dead_workers:
            _bury_dead_workers(state)


def _find_vanished_workers(state: PoolState) -> None:
    """Workers whose OS thread is gone without a word (its Python code never ran to the end)."""
    for tid, native_id in state.worker_native_ids.items():
        if tid not in state.dead_workers and not os_thread_exists(native_id):
            state.dead_workers[tid] = RuntimeError(f"its OS thread {native_id} is gone")


def _bury_dead_workers(state: PoolState) -> None:
    """Dead workers will never reach a barrier nor report: make threads waiting for them at a
    barrier abort, and report the current epoch finished on their behalf (nothing else writes
    their words any more)."""
    for tid in list(state.dead_workers):
        mark_gone(state.barrier, tid)
        report_finished(state.control, tid - 1, state.epoch)


def _broken_pool_error(state: PoolState) -> BrokenPool:
    tid, cause = next(iter(state.dead_workers.items()))
    error = BrokenPool(f"SpinPool worker thread {tid} of {state.num_threads} died ({cause!r}): "
                       "the pool cannot run kernels any more; close it and start a new one")
    error.__cause__ = cause
    return error


def _root_cause(errors: list[BaseException | None], barrier: np.ndarray) -> BaseException | None:
    """The exception `run` should raise: the first one that is not a consequence of another
    thread leaving (BarrierAborted); if there are only those, a mismatch in barrier counts."""
    raised = [error for error in errors if error is not None]
    for error in raised:
        if not isinstance(error, BarrierAborted):
            return error
    if raised:
        mismatch = BarrierAborted(
            f"kernel threads passed different numbers of barriers: {arrival_counts(barrier).tolist()}"
        )
        mismatch.__cause__ = raised[0]
        return mismatch
    return None


def _start_workers(state: PoolState) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=worker_main, args=(state, tid), name=f"SpinPool-worker-{tid}", daemon=True)
        for tid in range(1, state.num_threads)
    ]
    for tid, thread in enumerate(threads, start=1):
        thread.start()
        assert thread.ident is not None and thread.native_id is not None
        state.worker_idents.add(thread.ident)
        state.worker_native_ids[tid] = thread.native_id
    return threads


def _stop_workers(state: PoolState, threads: list[threading.Thread]) -> None:
    """Finalizer (close, garbage collection or interpreter exit): wake, stop and join workers.
    Daemon threads, so a pool nobody closed cannot block interpreter exit before this runs."""
    with state.run_lock:
        state.is_closed = True
        request_shutdown(state.control, state.epoch + 1)
        _unpin_callers(state)
    for tid, thread in enumerate(threads, start=1):
        if tid in state.dead_workers and not os_thread_exists(state.worker_native_ids[tid]):
            continue  # its OS thread vanished: Python would wait for it forever
        if thread is not threading.current_thread():
            thread.join()
    state.task = None  # release the last run's arguments


def _compile_helpers() -> None:
    """Load (or compile) every helper a worker calls before any worker exists, so that workers
    never compile and the first run is not slowed by it."""
    barrier, control = make_barrier(2), make_control(1)
    start_run(barrier, control, 1, 1)
    finish_share_and_spin(barrier, control, 1, 1, 1)
    finish_share_and_wait(barrier, control, 1, 1)
    arrival_counts(barrier)
    mark_gone(barrier, 1)
    report_finished(control, 0, 1)
    reset_barrier(barrier)
    wait_for_work(control, 0, 1)
    if announce_parking(control, 1):
        leave_parking(control)
    load_acquire_from_python(control, SHUTDOWN)
