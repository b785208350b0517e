"""Where `make test`'s numba compiling goes: runs pytest in this process and prints, per jitted function, the
seconds its compiles took (its own, without the functions it compiled on the way) and how many signatures.

    NUMBA_CACHE_DIR=/tmp/cold .venv/bin/python scripts/compile_times.py [pytest arguments]

Point NUMBA_CACHE_DIR at an empty directory to see a fresh clone's compiles (a warm cache loads instead:
loads are timed too, and take milliseconds). Only this process is timed, not the servers the tests start
(they mostly load what this process compiled first).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from threadpool.numba_cache import use_numba_cache  # noqa: E402

use_numba_cache()

import pytest  # noqa: E402
from numba.core import event  # noqa: E402


class CompileTimes(event.Listener):
    """Each compile's own seconds: its time less that of the compiles nested in it."""

    def __init__(self) -> None:
        self.open: list[list[float]] = []
        self.own: dict[str, float] = defaultdict(float)
        self.signatures: dict[str, int] = defaultdict(int)

    def on_start(self, ev: event.Event) -> None:
        self.open.append([time.perf_counter(), 0.0])

    def on_end(self, ev: event.Event) -> None:
        started, nested = self.open.pop()
        took = time.perf_counter() - started
        if self.open:
            self.open[-1][1] += took
        function = getattr(ev.data.get("dispatcher"), "py_func", None)
        name = f"{function.__module__}.{function.__qualname__}" if function else "?"
        self.own[name] += took - nested
        self.signatures[name] += 1


def main(args: list[str]) -> int:
    times = CompileTimes()
    event.register("numba:compile", times)
    started = time.perf_counter()
    status = pytest.main(args or ["-q", "-p", "no:cacheprovider"])
    total = sum(times.own.values())
    print(f"\ncompiling: {total:.0f} s of {time.perf_counter() - started:.0f} s\n")
    print("| seconds | signatures | function |\n| ---: | ---: | --- |")
    for name, seconds in sorted(times.own.items(), key=lambda item: -item[1])[:25]:
        print(f"| {seconds:.1f} | {times.signatures[name]} | {name} |")
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
