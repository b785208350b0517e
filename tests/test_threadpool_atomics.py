"""The numba atomics: each test would fail with a wrong ordering, a lost update or a hoisted load.

Two Python threads each call a `nogil` nopython function, so they truly run at the same time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

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
    words = np.zeros(4, dtype=np.int64)
    assert exercise_every_atomic(words) == (0, 42, 0, 7, 5)
    assert words[:3].tolist() == [3, 42, 7]


def test_atomics_reject_arrays_that_are_not_int64() -> None:
    load_first_word = njit(lambda words: load_acquire(words, 0))
    with pytest.raises(TypingError, match="int64"):
        load_first_word(np.zeros(2, dtype=np.int32))


def test_cache_aligned_zeros_start_on_a_cache_line() -> None:
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
    """Documents the failure our atomics prevent, in a subprocess that is killed afterwards."""
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD_SPIN], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "STILL SPINNING" in result.stdout
