"""A spin barrier for numba nopython code, with one cache line per thread.

Layout of the barrier array (int64, 8 words = one 64-byte cache line per row):

    line 0          header: word 0 = number of threads (read-only after `make_barrier`)
    line 1 + tid    thread tid's *arrival word*: how many barriers it has reached in this run,
                    plus the DEPARTED bit once it has left the kernel

Each thread writes only its own arrival line and reads the others': a barrier episode is one
release store and (n - 1) acquire loads per thread, no read-modify-write, so no line is contended
by writers (no false sharing, no `lock` traffic). With 2 threads that is one cache-line transfer
each way, the least any barrier can cost. Reading every other thread's line is O(n) per thread,
fine for the few cores this engine targets; a counter-based barrier would scale better past ~16.

Why counting works: a thread at episode e waits until every other arrival count is >= e. No thread
can be more than one episode ahead of the slowest, so counts only grow and ">=" never misreads.

Aborting: a thread that leaves the kernel (it returned, or raised) gets DEPARTED set on its line by
the pool. A thread waiting for it then raises `BarrierAborted` instead of spinning forever, so one
failing thread makes every other thread fail at its next barrier and `pool.run` can return.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from threadpool.atomics import (
    WORDS_PER_CACHE_LINE,
    cache_aligned_zeros,
    cpu_pause,
    load_acquire,
    store_release,
)

_NUM_THREADS_WORD = 0
DEPARTED = np.int64(1 << 62)
ARRIVALS_MASK = np.int64((1 << 62) - 1)


class BarrierAborted(RuntimeError):
    """Raised inside a kernel at a barrier that another thread will never reach."""


def make_barrier(num_threads: int) -> np.ndarray:
    """A barrier for `num_threads` threads: int64 array of shape ((1 + num_threads) * 8,),
    64-byte aligned so that each thread's arrival word sits alone on its cache line."""
    if num_threads < 1:
        raise ValueError(f"a barrier needs at least one thread, got {num_threads}")
    barrier = cache_aligned_zeros((1 + num_threads) * WORDS_PER_CACHE_LINE)
    barrier[_NUM_THREADS_WORD] = num_threads
    return barrier


@njit(nogil=True, cache=True)
def _arrival_word(tid: int) -> int:
    return (1 + tid) * WORDS_PER_CACHE_LINE


@njit(nogil=True, cache=True, _nrt=False)
def _wait_for_arrival(barrier: np.ndarray, other: int, episode: int) -> None:
    """Spin until thread `other` has reached barrier number `episode` (or raise if it left)."""
    word = _arrival_word(other)
    while True:
        # acquire: once we see its arrival we also see everything it wrote before arriving.
        seen: int = load_acquire(barrier, word)
        if (seen & ARRIVALS_MASK) >= episode:
            return
        if seen & DEPARTED:
            raise BarrierAborted("another thread left the kernel (it raised or returned early) "
                                 "before reaching this barrier")
        cpu_pause()


@njit(nogil=True, cache=True, _nrt=False)
def barrier_wait(barrier: np.ndarray, tid: int) -> None:
    """Block thread `tid` until all threads of `barrier` have called `barrier_wait` as many times.

    Writes made by any thread before the barrier are visible to every thread after it. Raises
    `BarrierAborted` if a thread this one waits for has left the kernel. Callable from any
    `@njit(nogil=True)` function; every thread must call it the same number of times.
    """
    num_threads = barrier[_NUM_THREADS_WORD]
    mine = _arrival_word(tid)
    # Only this thread writes its own word (the pool resets it between runs, while we are idle).
    episode = (load_acquire(barrier, mine) & ARRIVALS_MASK) + 1
    # release: publishes every write this thread made before the barrier.
    store_release(barrier, mine, episode)
    for other in range(num_threads):
        if other != tid:
            _wait_for_arrival(barrier, other, episode)


@njit(nogil=True, cache=True)
def mark_departed(barrier: np.ndarray, tid: int) -> None:
    """Record that thread `tid` left the kernel: threads still waiting for it will abort."""
    mine = _arrival_word(tid)
    # release: a waiter that sees DEPARTED also sees the thread's final arrival count.
    store_release(barrier, mine, load_acquire(barrier, mine) | DEPARTED)


@njit(nogil=True, cache=True)
def mark_gone(barrier: np.ndarray, tid: int) -> None:
    """Record that thread `tid` died and will never arrive again: threads waiting for it abort.
    A plain store, not `mark_departed`'s read-modify-write, so that the dying thread and thread 0
    may both write it (the same value) without racing."""
    # release: as in mark_departed; the count is dropped, the run fails anyway.
    store_release(barrier, _arrival_word(tid), DEPARTED)


@njit(nogil=True, cache=True)
def arrival_counts(barrier: np.ndarray) -> np.ndarray:
    """How many barriers each thread reached since the last reset: int64 (num_threads,)."""
    num_threads = barrier[_NUM_THREADS_WORD]
    counts = np.empty(num_threads, dtype=np.int64)
    for tid in range(num_threads):
        counts[tid] = load_acquire(barrier, _arrival_word(tid)) & ARRIVALS_MASK
    return counts


@njit(nogil=True, cache=True)
def reset_barrier(barrier: np.ndarray) -> None:
    """Zero every arrival word. Only while no thread is inside the barrier (between runs)."""
    for tid in range(barrier[_NUM_THREADS_WORD]):
        # release: the next run's kick-off (itself a release) carries the reset to the workers.
        store_release(barrier, _arrival_word(tid), 0)
