"""Which cores this process may use, and pinning one thread to one of them (Linux)."""

from __future__ import annotations

import os


def usable_cores() -> list[int]:
    """The cores the process may run on (honours taskset, cgroups' cpusets), in ascending order."""
    return sorted(os.sched_getaffinity(0))


def pin_thread(native_thread_id: int, core: int) -> None:
    """Restrict one thread (by its kernel thread id, `threading.get_native_id()`) to one core.

    On Linux, sched_setaffinity given a thread id affects only that thread, not the process.
    """
    os.sched_setaffinity(native_thread_id, {core})


def thread_affinity(native_thread_id: int) -> set[int]:
    """The cores one thread may run on."""
    return os.sched_getaffinity(native_thread_id)


def pin_calling_thread(core: int) -> set[int] | None:
    """Restrict the calling thread to `core`; returns the cores it had before, to restore with
    `restore_calling_thread`, or None when it was already pinned there (nothing to undo)."""
    previous = os.sched_getaffinity(0)  # pid 0: the calling thread, not the whole process
    if previous == {core}:
        return None
    os.sched_setaffinity(0, {core})
    return previous


def restore_calling_thread(previous: set[int] | None) -> None:
    if previous is not None:
        os.sched_setaffinity(0, previous)
