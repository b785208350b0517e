"""What the pool's worker threads run, and the state they share with thread 0 (`PoolState`).

A worker waits for an epoch (spinning, then parked on a futex), serves the current task, reports the
epoch finished, and spins for the next one. A numba kernel seen a second time is served by
`serve_task`, a nopython trampoline that runs every following epoch of the same task without taking
the GIL; a new task, a park or shutdown return to Python. A kernel's exception is recorded for the
caller of `run`; an exception outside any kernel marks the worker dead (`PoolState.dead_workers`) so
that thread 0 stops waiting for it. `threadpool.pool` is the caller's side.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import njit
from numba.core.registry import CPUDispatcher

from threadpool.atomics import load_acquire
from threadpool.barrier import make_barrier, mark_departed, mark_gone
from threadpool.handoff import (
    EPOCH,
    SHUTDOWN,
    TASK,
    load_acquire_from_python,
    make_control,
    report_finished,
    spin_while_equal,
    wait_for_work,
)

Kernel = Callable[..., Any]  # kernel(tid, nthreads, barrier, *args)


class Task:
    """A kernel and its arguments; `task_id` changes whenever either does."""

    __slots__ = ("args", "is_numba", "kernel", "task_id", "trampoline")

    def __init__(self, kernel: Kernel, args: tuple[Any, ...], task_id: int) -> None:
        self.kernel = kernel
        self.args = args
        self.task_id = task_id
        self.is_numba = isinstance(kernel, CPUDispatcher)  # served from the nopython trampoline
        # serve_task compiled for this task's types, called without numba's type dispatch
        # (~6 us, mostly typing the dispatcher argument, on every re-entry after a park).
        self.trampoline: Callable[..., tuple[int, int]] | None = None

    def is_same(self, kernel: Kernel, args: tuple[Any, ...]) -> bool:
        return kernel is self.kernel and len(args) == len(self.args) and all(
            new is old or (type(new) is type(old) and np.isscalar(new) and new == old)
            for new, old in zip(args, self.args, strict=True)
        )

    def compiled_trampoline(self, barrier: np.ndarray, control: np.ndarray) -> Callable[..., tuple[int, int]]:
        if self.trampoline is None:
            example_args = (self.kernel, 1, barrier, control, self.args, 0, 0, 0)
            self.trampoline = serve_task.compile(tuple(numba.typeof(value) for value in example_args))
        return self.trampoline


class PoolState:
    """Everything the workers share with the pool. Holds no reference to the SpinPool, so that
    dropping the last reference to the pool runs its finalizer, which stops the workers."""

    __slots__ = (
        "barrier",
        "control",
        "dead_workers",
        "epoch",
        "errors",
        "is_closed",
        "max_spins",
        "num_threads",
        "pinned_callers",
        "run_lock",
        "running_thread",
        "task",
        "worker_idents",
        "worker_native_ids",
    )

    def __init__(self, num_threads: int, max_spins: int) -> None:
        self.num_threads = num_threads
        self.barrier: np.ndarray = make_barrier(num_threads)  # int64 ((1 + n) * 8,)
        self.control: np.ndarray = make_control(num_threads - 1)  # int64 ((2 + n - 1) * 8,)
        self.max_spins = max_spins
        self.epoch = 0  # runs started so far; written by thread 0 under run_lock
        self.task: Task | None = None  # the latest run's; kept to recognise the same task
        self.errors: list[BaseException | None] = [None] * num_threads
        self.run_lock = threading.Lock()
        self.running_thread: int | None = None
        self.worker_idents: set[int] = set()
        self.worker_native_ids: dict[int, int] = {}  # tid -> kernel thread id, for /proc/self/task
        # tid -> why it ended; written by the dying worker (or by thread 0 when the OS thread vanished)
        self.dead_workers: dict[int, BaseException] = {}
        # Calling threads pinned by run(), with the cores to give back at close().
        self.pinned_callers: dict[threading.Thread, set[int] | None] = {}
        self.is_closed = False


def record_error(state: PoolState, tid: int, exc: BaseException) -> None:
    exc.add_note(f"raised in SpinPool thread {tid} of {state.num_threads}")
    state.errors[tid] = exc


def os_thread_exists(native_id: int) -> bool:
    return os.path.exists(f"/proc/self/task/{native_id}")


@njit(nogil=True)  # not cache=True: numba cannot cache a function taking a dispatcher argument
def serve_task(kernel: Any, tid: int, barrier: np.ndarray, control: np.ndarray, args: tuple[Any, ...],
               task_id: int, epoch: int, max_spins: int) -> tuple[int, int]:
    """Worker `tid`: run `kernel` for `epoch`, then for every following epoch of the same task,
    all in nopython. Returns (last epoch run, next epoch): next == last when no run came within
    `max_spins` (time to park), else a run of another task, or shutdown, that Python must see."""
    num_threads = barrier[0]
    while True:
        kernel(tid, num_threads, barrier, *args)
        next_epoch = finish_share_and_spin(barrier, control, tid, epoch, max_spins)
        # acquire: kick_off's release store of the epoch made TASK and SHUTDOWN visible.
        if next_epoch == epoch or load_acquire(control, TASK) != task_id or load_acquire(control, SHUTDOWN):
            return epoch, next_epoch
        epoch = next_epoch


@njit(nogil=True, cache=True, _nrt=False)
def finish_share_and_spin(barrier: np.ndarray, control: np.ndarray, tid: int, epoch: int,
                          max_spins: int) -> int:
    """Worker `tid`, after its share: leave the barrier, report run `epoch` finished, then spin
    for the next epoch; returns it, or `epoch` if `max_spins` passed without one."""
    mark_departed(barrier, tid)
    report_finished(control, tid - 1, epoch)
    return spin_while_equal(control, EPOCH, epoch, max_spins)


def _serve(state: PoolState, tid: int, epoch: int, previous_task_id: int) -> tuple[int, int]:
    """Run the current task for `epoch`; returns (last epoch run, next epoch), like `serve_task`.

    A task seen for the first time is called from Python (entering the trampoline costs a slower
    dispatch, wasted if the arguments change every run); from its second run on, a numba kernel
    is served by `serve_task` for as long as it stays the current task."""
    task = state.task
    assert task is not None
    try:
        if task.is_numba and task.task_id == previous_task_id:
            trampoline = task.compiled_trampoline(state.barrier, state.control)
            return trampoline(task.kernel, tid, state.barrier, state.control, task.args, task.task_id,
                              epoch, state.max_spins)
        task.kernel(tid, state.num_threads, state.barrier, *task.args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller of run()
        epoch = load_acquire_from_python(state.control, EPOCH)  # thread 0 is waiting for this one
        record_error(state, tid, exc)
    return epoch, finish_share_and_spin(state.barrier, state.control, tid, epoch, state.max_spins)


def worker_main(state: PoolState, tid: int) -> None:
    """A worker's whole life; if it ends by an exception (kernels' are caught in `_serve`, so
    this one came from outside any kernel), it says so rather than leave thread 0 waiting."""
    try:
        _serve_until_shutdown(state, tid)
    except BaseException as exc:  # noqa: BLE001 - reported by every later run as BrokenPool
        state.dead_workers[tid] = exc  # first, so that a run starting now sees it (see _run_locked)
        mark_gone(state.barrier, tid)  # a thread 0 waiting at a barrier for this worker aborts


def _serve_until_shutdown(state: PoolState, tid: int) -> None:
    """Wait for an epoch, serve it, park when idle; until shutdown."""
    epoch = wait_for_work(state.control, 0, state.max_spins)
    previous_task_id = 0
    while not load_acquire_from_python(state.control, SHUTDOWN):
        task_id = state.task.task_id if state.task is not None else 0
        last_run, epoch = _serve(state, tid, epoch, previous_task_id)
        previous_task_id = task_id
        if epoch == last_run:  # spun for spin_us in vain: park
            epoch = wait_for_work(state.control, last_run, state.max_spins)
