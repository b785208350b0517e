"""Which cores this process may use, and pinning threads to them (Linux)."""

from __future__ import annotations

import os
from collections.abc import Iterable


def usable_cores() -> list[int]:
    """The cores the calling thread may run on (honours taskset and cgroup cpusets), ascending."""
    return sorted(os.sched_getaffinity(0))


def pin_thread(native_thread_id: int, core: int) -> None:
    """Restrict one thread (by its kernel thread id, `threading.get_native_id()`) to one core.

    On Linux, sched_setaffinity given a thread id affects only that thread, not the process.
    """
    os.sched_setaffinity(native_thread_id, {core})


def set_thread_affinity(native_thread_id: int, cores: Iterable[int]) -> None:
    """Allow one thread on `cores` (e.g. give back what `pin_calling_thread` took); a thread
    that has exited meanwhile is ignored."""
    try:
        os.sched_setaffinity(native_thread_id, set(cores))
    except ProcessLookupError:
        pass


def pin_calling_thread(core: int) -> set[int] | None:
    """Restrict the calling thread to `core`; returns the cores it had before, or None when it
    was already pinned there."""
    previous = os.sched_getaffinity(0)  # pid 0: the calling thread, not the whole process
    if previous == {core}:
        return None
    os.sched_setaffinity(0, {core})
    return previous
