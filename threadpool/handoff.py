"""How the calling thread hands a run to the workers and learns that they are done.

The control words (int64 array, one 64-byte line per row):

    line 0        word 0: the run *epoch*, bumped by thread 0 to kick off a run; its low 32 bits
                  are the futex word parked workers sleep on.  word 1: SHUTDOWN flag.
                  word 2: the TASK id, which changes when a run's kernel or arguments differ
                  from the previous run's (workers then fetch the new task from Python).
    line 1        word 8: how many workers are parked (or about to park) on the futex
    line 2 + w    word (2 + w) * 8: the last epoch worker w finished (written only by worker w)

Workers wait for a new epoch by spinning with `pause` for a bounded number of iterations, then
park on a futex so that an idle pool burns no CPU. Spin-then-park is Dekker's pattern:

    worker:   num_parked += 1;  fence;  if epoch unchanged: futex_wait(epoch)
    thread 0: epoch += 1;       fence;  if num_parked > 0:  futex_wake(epoch)

The seq_cst fences forbid each side's store from passing its following load, so at least one side
sees the other's store: either the worker sees the new epoch and does not sleep, or thread 0 sees
it parked and wakes it. futex_wait itself re-checks the epoch in the kernel, which closes the gap
between the worker's check and its sleep. No wake-up is ever lost.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
import time

import numpy as np
from numba import njit

from threadpool.atomics import (
    WORDS_PER_CACHE_LINE,
    cache_aligned_zeros,
    cpu_pause,
    fence_seq_cst,
    fetch_add,
    load_acquire,
    store_release,
)

EPOCH = 0
SHUTDOWN = 1
TASK = 2
NUM_PARKED = 8


def make_control(num_workers: int) -> np.ndarray:
    """Control words for a pool with `num_workers` workers: int64 ((2 + num_workers) * 8,)."""
    return cache_aligned_zeros((2 + num_workers) * WORDS_PER_CACHE_LINE)


@njit(nogil=True, cache=True)
def _finished_word(worker: int) -> int:
    return (2 + worker) * WORDS_PER_CACHE_LINE


# ---- spinning -----------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def spin_while_equal(words: np.ndarray, index: int, seen: int, max_spins: int) -> int:
    """Spin (with `pause`) until `words[index] != seen` or `max_spins` iterations passed; returns
    the last value read (== `seen` on timeout)."""
    for _ in range(max_spins):
        # acquire: a plain load would be hoisted out of the loop and spin forever.
        value: int = load_acquire(words, index)
        if value != seen:
            return value
        cpu_pause()
    return load_acquire(words, index)


@njit(nogil=True, cache=True)
def calibrate_spin(num_spins: int) -> int:
    """The loop of `spin_while_equal` on a word that never changes; used to time one spin."""
    words = np.zeros(1, dtype=np.int64)
    return spin_while_equal(words, 0, 0, num_spins)


@functools.cache
def nanoseconds_per_spin() -> float:
    """Duration of one spin iteration (an atomic load and a `pause`), best of a few tries;
    measured once per process (pause takes ~10-150 cycles depending on the CPU)."""
    num_spins = 20_000
    calibrate_spin(1)  # compile or load from cache outside the timing
    best_seconds = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        calibrate_spin(num_spins)
        best_seconds = min(best_seconds, time.perf_counter() - start)
    return max(best_seconds * 1e9 / num_spins, 1.0)


# ---- thread 0: kick off a run, wait for the workers --------------------------------------------


@njit(nogil=True, cache=True)
def kick_off(control: np.ndarray, epoch: int) -> int:
    """Publish run `epoch` to the workers; returns how many are parked and need a futex wake."""
    # release: workers that see the new epoch also see the task and the reset barrier.
    store_release(control, EPOCH, epoch)
    # seq_cst: our epoch store must not pass the load of NUM_PARKED below (Dekker, see module doc).
    fence_seq_cst()
    return load_acquire(control, NUM_PARKED)


@njit(nogil=True, cache=True)
def wait_for_workers(control: np.ndarray, num_workers: int, epoch: int, max_spins: int) -> bool:
    """Spin until every worker has finished run `epoch`; False if `max_spins` ran out first."""
    for worker in range(num_workers):
        word = _finished_word(worker)
        # acquire: pairs with report_finished, so we see all of the worker's results.
        while load_acquire(control, word) != epoch:
            if max_spins <= 0:
                return False
            max_spins -= 1
            cpu_pause()
    return True


# ---- workers: wait for work, park, report -------------------------------------------------------


@njit(nogil=True, cache=True)
def announce_parking(control: np.ndarray, seen_epoch: int) -> bool:
    """Register as parked; True if the epoch is still `seen_epoch`, so sleeping is safe."""
    # acq_rel RMW (a full barrier on x86 already); the fence states the Dekker requirement.
    fetch_add(control, NUM_PARKED, 1)
    fence_seq_cst()
    if load_acquire(control, EPOCH) != seen_epoch:
        fetch_add(control, NUM_PARKED, -1)
        return False
    return True


@njit(nogil=True, cache=True)
def leave_parking(control: np.ndarray) -> None:
    fetch_add(control, NUM_PARKED, -1)  # acq_rel; only a count, nothing is published through it


@njit(nogil=True, cache=True)
def report_finished(control: np.ndarray, worker: int, epoch: int) -> None:
    # release: thread 0's acquire in wait_for_workers then sees everything this run wrote.
    store_release(control, _finished_word(worker), epoch)


def wait_for_work(control: np.ndarray, seen_epoch: int, max_spins: int) -> int:
    """Return the next epoch after `seen_epoch`: spin for `max_spins`, then park on the futex."""
    while True:
        epoch = spin_while_equal(control, EPOCH, seen_epoch, max_spins)
        if epoch != seen_epoch:
            return epoch
        if announce_parking(control, seen_epoch):
            futex_wait(epoch_futex_address(control), seen_epoch)
            leave_parking(control)


def request_shutdown(control: np.ndarray, epoch: int) -> None:
    """Make every worker, spinning or parked, return from `wait_for_work` and see SHUTDOWN."""
    store_release_from_python(control, SHUTDOWN, 1)
    kick_off(control, epoch)
    futex_wake_all(epoch_futex_address(control))  # unconditionally: shutdown is not hot


@njit(nogil=True, cache=True)
def store_release_from_python(words: np.ndarray, index: int, value: int) -> None:
    store_release(words, index, value)  # release: see the callers


@njit(cache=True)  # keeps the GIL: it never blocks, and re-taking the GIL can
def load_acquire_from_python(words: np.ndarray, index: int) -> int:
    return load_acquire(words, index)  # acquire: see the callers


# ---- futex (Linux) ------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine(), -1)
_FUTEX_WAIT_PRIVATE = 0 | 128
_FUTEX_WAKE_PRIVATE = 1 | 128
_INT32_MAX = 2**31 - 1
# CDLL (not PyDLL) calls release the GIL: a parked worker holds nothing.
_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long


def epoch_futex_address(control: np.ndarray) -> int:
    """Address of the epoch's low 32 bits (little-endian), the futex word."""
    if _SYS_FUTEX < 0 or sys.byteorder != "little":
        raise OSError(f"futex parking is implemented for little-endian Linux, not {platform.machine()}")
    return control.ctypes.data + EPOCH * 8


def futex_wait(address: int, expected: int) -> None:
    """Sleep until woken, unless the 32-bit word at `address` no longer equals `expected`.
    May return spuriously (EINTR, EAGAIN): callers re-check their condition."""
    _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(_FUTEX_WAIT_PRIVATE),
        ctypes.c_long(expected & 0xFFFFFFFF), ctypes.c_void_p(None), ctypes.c_void_p(None),
        ctypes.c_long(0),
    )


def futex_wake_all(address: int) -> None:
    """Wake every thread sleeping in `futex_wait` on `address`."""
    _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(_FUTEX_WAKE_PRIVATE),
        ctypes.c_long(_INT32_MAX), ctypes.c_void_p(None), ctypes.c_void_p(None), ctypes.c_long(0),
    )
