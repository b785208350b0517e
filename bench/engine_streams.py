"""Requests submitted to an engine at once and read to their ends, each on its own reader thread."""

from __future__ import annotations

import threading
import time

from decoding.engine.engine import Engine
from decoding.engine.params import SamplingParams


def generate_together(engine: Engine, prompt_ids: list[int] | list[list[int]],
                      params: list[SamplingParams]) -> tuple[int, float]:  # fmt: skip
    """One request per `params`, all submitted at once (with one prompt, or each with its own): the tokens
    they produced, and the seconds from submission to the last one's end."""
    counts = [0] * len(params)
    prompts = prompt_ids if prompt_ids and isinstance(prompt_ids[0], list) else [prompt_ids] * len(params)
    started = time.perf_counter()
    streams = [engine.submit(prompt, p) for prompt, p in zip(prompts, params, strict=True)]

    def drain(i: int) -> None:
        counts[i] = sum(len(o.token_ids) for o in streams[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - started
