"""The numba atomics of threadpool/atomics.py, and what each test can really catch.

x86-64 is TSO: the hardware never moves a load before an earlier load, nor a store before an
earlier store, so acquire loads and release stores compile to plain `mov`s and a message-passing
test passes on x86 even with relaxed orderings. Here, then, the tests guard atomicity (a lost
update), the compiler (a load hoisted out of a spin loop, plain accesses moved across the atomics)
and the one reordering x86 does: a store passing a later load of another location through the
store buffer, which only `fence_seq_cst` forbids (the store-buffering litmus test shows the
reordering without the fence, then its absence with it). On ARM or POWER the message-passing test
would also catch a wrong ordering; on x86 each docstring says what it guards.

Two Python threads each call a `nogil` nopython function (or a SpinPool runs a kernel on two
threads), so they truly run at the same time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from threadpool import SpinPool, barrier_wait
from threadpool.atomics import (
    WORDS_PER_CACHE_LINE,
    cache_aligned_zeros,
    compare_exchange,
    cpu_pause,
    fence_seq_cst,
    fetch_add,
    load_acquire,
    store_release,
)

pytestmark = pytest.mark.timeout(120)

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def run_in_two_threads(first: Callable[[], object], second: Callable[[], object]) -> list[object]:
    """Run two callables concurrently on two Python threads, each pinned to its own core when
    there are two (two spinners stacked on one core by a busy scheduler crawl); returns their
    results in order."""
    results: list[object] = [None, None]
    errors: list[BaseException] = []
    cores = sorted(os.sched_getaffinity(0))

    def call(index: int, function: Callable[[], object]) -> None:
        os.sched_setaffinity(0, {cores[index % len(cores)]})  # this thread only; it ends below
        try:
            results[index] = function()
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i, f)) for i, f in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# ---- single-threaded semantics -------------------------------------------------------------------


@njit(nogil=True, cache=True)
def exercise_every_atomic(words: np.ndarray) -> tuple[int, int, int, int, int]:
    old_sum = fetch_add(words, 0, 5)
    store_release(words, 1, 42)
    loaded = load_acquire(words, 1)
    swapped_from = compare_exchange(words, 2, 0, 7)  # 0 == 0: exchanges
    refused_from = compare_exchange(words, 2, 0, 9)  # 7 != 0: leaves 7
    fence_seq_cst()
    cpu_pause()
    return old_sum, loaded, swapped_from, refused_from, fetch_add(words, 0, -2)


def test_atomics_return_documented_values() -> None:
    """Single-threaded: each intrinsic returns what its docstring says (fetch_add and
    compare_exchange the old value). Guards the code generation, not any ordering."""
    words = np.zeros(4, dtype=np.int64)
    assert exercise_every_atomic(words) == (0, 42, 0, 7, 5)
    assert words[:3].tolist() == [3, 42, 7]


def test_atomics_reject_arrays_that_are_not_int64() -> None:
    """Typing: a wrong dtype is a compile error, not a misread word."""
    load_first_word = njit(lambda words: load_acquire(words, 0))
    with pytest.raises(TypingError, match="int64"):
        load_first_word(np.zeros(2, dtype=np.int32))


def test_cache_aligned_zeros_start_on_a_cache_line() -> None:
    """Layout only: words meant to own a cache line start on one."""
    for num_words in (1, 8, 17, 100):
        words = cache_aligned_zeros(num_words)
        assert words.shape == (num_words,) and words.dtype == np.int64
        assert words.ctypes.data % (WORDS_PER_CACHE_LINE * 8) == 0
        assert not words.any()


# ---- read-modify-write from two threads ----------------------------------------------------------


@njit(nogil=True, cache=True)
def add_one_many_times(words: np.ndarray, times: int) -> None:
    for _ in range(times):
        fetch_add(words, 0, 1)


def test_fetch_add_from_two_threads_loses_no_update() -> None:
    """Guards atomicity (`lock xadd`): a load-add-store that is not one atomic instruction loses
    updates when two cores interleave (if the compiler keeps it in the loop at all: LLVM folds a
    plain `+= 1` loop into one add). Any ordering, relaxed included, passes: the acq_rel ordering
    is not what this tests."""
    words = np.zeros(1, dtype=np.int64)
    times = 2_000_000
    add_one_many_times(words, 1)  # compile outside the threads
    words[0] = 0
    run_in_two_threads(lambda: add_one_many_times(words, times), lambda: add_one_many_times(words, times))
    assert words[0] == 2 * times


@njit(nogil=True, cache=True)
def increment_under_spinlock(words: np.ndarray, times: int) -> None:
    """words[0] is a lock (0 free, 1 held); words[8] a plain counter it protects."""
    for _ in range(times):
        while compare_exchange(words, 0, 0, 1) != 0:  # returns the old value: 0 means we took it
            cpu_pause()
        words[8] += 1  # plain read-modify-write, safe only because of the lock
        store_release(words, 0, 0)


def test_compare_exchange_builds_a_lock_that_loses_no_update() -> None:
    """Guards atomicity of `lock cmpxchg` (a compare-then-store that is not atomic lets both
    threads into the critical section) and that the compiler keeps the plain `+=` between the
    exchange (acquire) and the unlock (release). On x86 the hardware would not move it out even
    with relaxed orderings (TSO), so the orderings are tested only as far as the compiler goes."""
    words = np.zeros(16, dtype=np.int64)
    times = 300_000
    increment_under_spinlock(words, 1)
    words[8] = 0
    run_in_two_threads(
        lambda: increment_under_spinlock(words, times), lambda: increment_under_spinlock(words, times)
    )
    assert words[8] == 2 * times
    assert words[0] == 0


# ---- message passing: release store / acquire load -----------------------------------------------

_FLAG, _ACK = 0, 8  # on separate cache lines
_DATA_WORDS = 16


@njit(nogil=True, cache=True)
def publish_rounds(flags: np.ndarray, data: np.ndarray, rounds: int) -> None:
    """Producer: fill data with the round number, release the flag, wait for the ack."""
    for round_number in range(1, rounds + 1):
        for k in range(data.size):
            data[k] = round_number  # plain stores, made visible by the release below
        store_release(flags, _FLAG, round_number)
        while load_acquire(flags, _ACK) != round_number:
            cpu_pause()


@njit(nogil=True, cache=True)
def consume_rounds(flags: np.ndarray, data: np.ndarray, rounds: int) -> int:
    """Consumer: acquire the flag, check every data word is at least that round; count stale reads."""
    num_stale = 0
    for round_number in range(1, rounds + 1):
        while load_acquire(flags, _FLAG) < round_number:
            cpu_pause()
        for k in range(data.size):
            if data[k] < round_number:  # plain loads, ordered after the acquire
                num_stale += 1
        store_release(flags, _ACK, round_number)
    return num_stale


def test_data_written_before_a_release_store_is_seen_after_the_acquire_load() -> None:
    """Message passing. On x86 the hardware never lets the data stores pass the flag store nor
    the data loads pass the flag load (TSO), so this passes even with relaxed orderings: here it
    guards only that the compiler keeps the plain data accesses on their side of the release
    store and the acquire load. On a weakly ordered CPU (ARM, POWER) it would catch a wrong
    ordering too."""
    flags = cache_aligned_zeros(16)
    data = np.zeros(_DATA_WORDS, dtype=np.int64)
    rounds = 50_000
    publish_rounds(flags, data, 0)
    consume_rounds(flags, data, 0)
    _, num_stale = run_in_two_threads(
        lambda: publish_rounds(flags, data, rounds), lambda: consume_rounds(flags, data, rounds)
    )
    assert num_stale == 0
    assert flags[_FLAG] == flags[_ACK] == rounds


# ---- spinning: an atomic load is re-read, a plain one is hoisted ---------------------------------


@njit(nogil=True, cache=True)
def spin_until_nonzero(words: np.ndarray, max_spins: int) -> int:
    """Spin on an acquire load; returns the spins it took, or -1 if max_spins ran out."""
    for spins in range(max_spins):
        if load_acquire(words, 0) != 0:
            return spins
        cpu_pause()
    return -1


def test_spin_on_acquire_load_sees_a_store_from_another_thread() -> None:
    """Guards that `load_acquire` re-reads memory on every spin: an atomic load is never hoisted
    out of a loop. Any atomic ordering, relaxed included, passes; a plain load would spin until
    the timeout (see the next test)."""
    words = np.zeros(1, dtype=np.int64)
    spin_until_nonzero(np.ones(1, dtype=np.int64), 1)
    setter = threading.Timer(0.05, lambda: words.__setitem__(0, 1))
    setter.start()
    spins = spin_until_nonzero(words, 10**11)  # ~an hour of spinning: the store ends it long before
    setter.join()
    assert spins > 0


PLAIN_LOAD_SPIN = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    from numba import njit

    @njit(nogil=True)
    def spin_on_plain_load(words):
        while words[0] == 0:  # LLVM hoists this load: the loop never re-reads memory
            pass

    words = np.zeros(1, dtype=np.int64)
    spin_on_plain_load(np.ones(1, dtype=np.int64))
    spinner = threading.Thread(target=spin_on_plain_load, args=(words,), daemon=True)
    spinner.start()
    time.sleep(0.1)
    words[0] = 1
    spinner.join(timeout=3)
    print("STILL SPINNING" if spinner.is_alive() else "RETURNED", flush=True)
    import os; os._exit(0)  # do not wait for the stuck daemon thread
    """
)


def test_spin_on_plain_load_hangs_which_is_why_atomics_are_needed() -> None:
    """Checks an LLVM optimisation, not project code: a spin on a plain array read is hoisted
    out of the loop and never ends, which is why every flag read in threadpool/ is an atomic
    load. Runs in a subprocess that exits without waiting for the stuck thread."""
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD_SPIN], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "STILL SPINNING" in result.stdout


# ---- store buffering (Dekker): the reordering x86 does, and fence_seq_cst ---------------------------

_X, _Y = 0, WORDS_PER_CACHE_LINE  # on separate cache lines


@njit(nogil=True, cache=True)
def store_then_load_rounds(tid: int, nthreads: int, barrier: np.ndarray, words: np.ndarray, seen: np.ndarray,
                           use_fence: bool) -> None:
    """Two threads, round i after a barrier: thread 0 stores x = i + 1 then loads y, thread 1
    stores y = i + 1 then loads x, with `fence_seq_cst` between when use_fence.

    seen[tid, i] = the value loaded: i + 1 if the other thread's store of round i was visible,
    i if not (the other cannot be a round ahead: that needs this thread at the next barrier).
    words: int64 (16,), cache-aligned; seen: int64 (2, num_rounds).
    """
    mine, other = (_X, _Y) if tid == 0 else (_Y, _X)
    for i in range(seen.shape[1]):
        barrier_wait(barrier, tid)  # both threads start the round together
        store_release(words, mine, i + 1)  # release: a plain mov on x86, free to pass the load below
        if use_fence:
            fence_seq_cst()  # mfence: the store leaves the store buffer before the load runs
        seen[tid, i] = load_acquire(words, other)


def count_both_stale(use_fence: bool, max_rounds: int, budget_s: float, stop_at_first: bool) -> tuple[int, int]:
    """Runs rounds of `store_then_load_rounds` on a pinned 2-thread pool in batches, until
    max_rounds or budget_s (a loaded machine makes a round cost a time slice); returns (rounds in
    which both threads loaded the other's old value, rounds run)."""
    batch = 20_000
    num_both_stale = num_rounds = 0
    deadline = time.monotonic() + budget_s
    with SpinPool(2) as pool:
        while num_rounds < max_rounds and (num_rounds == 0 or time.monotonic() < deadline):
            words = cache_aligned_zeros(16)
            seen = np.zeros((2, batch), dtype=np.int64)
            pool.run(store_then_load_rounds, words, seen, use_fence)
            stale = seen == np.arange(batch)
            num_both_stale += int(np.count_nonzero(stale[0] & stale[1]))
            num_rounds += batch
            if stop_at_first and num_both_stale:
                break
    return num_both_stale, num_rounds


@pytest.mark.skipif(not TWO_CORES, reason="store buffering shows only between two cores running at once")
def test_without_a_fence_x86_lets_each_store_pass_the_following_load() -> None:
    """A check of the hardware and of this harness, not of project code: with only release and
    acquire, both threads load the other's old value in some rounds (x86 does this in a few
    percent of them), the outcome sequential consistency forbids. It is what gives the next test
    its power: the same harness does see the reordering when the fence is missing."""
    num_both_stale, num_rounds = count_both_stale(use_fence=False, max_rounds=1_000_000, budget_s=20.0,
                                                  stop_at_first=True)
    assert num_both_stale > 0, f"no store-load reordering seen in {num_rounds} rounds"


@pytest.mark.skipif(not TWO_CORES, reason="store buffering shows only between two cores running at once")
def test_fence_seq_cst_forbids_a_store_passing_the_following_load() -> None:
    """Guards `fence_seq_cst` (it must emit a full fence, `mfence`), which the pool's
    spin-then-park handshake relies on: with it between each thread's store and load, no round
    may end with both threads having missed the other's store. Without it the same harness sees
    that outcome (previous test)."""
    num_both_stale, num_rounds = count_both_stale(use_fence=True, max_rounds=200_000, budget_s=20.0,
                                                  stop_at_first=False)
    assert num_both_stale == 0, f"{num_both_stale} of {num_rounds} rounds saw both stores reordered"
