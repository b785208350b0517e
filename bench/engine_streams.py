"""Requests submitted to an engine at once and read to their ends, each on its own reader thread."""

from __future__ import annotations

import threading
import time

from decoding.engine.engine import Engine
from decoding.engine.params import SamplingParams


def generate_together(engine: Engine, prompt_ids: list[int], params: list[SamplingParams]) -> tuple[int, float]:
    """One request per `params`, all submitted at once: the tokens they produced, and the seconds from
    submission to the last one's end."""
    counts = [0] * len(params)
    started = time.perf_counter()
    streams = [engine.submit(prompt_ids, p) for p in params]

    def drain(i: int) -> None:
        counts[i] = sum(len(o.token_ids) for o in streams[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - started
