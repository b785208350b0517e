"""`treadle bench churn`: where the inter-token tail of many streams comes from.

    treadle bench churn --streams 32 --seconds 30 --json bench-results/churn.json

A closed loop of `--streams` slots on an engine in this process, each submitting its next request as
soon as its last one ends (a server's arrival churn), every request a unique ~`--prompt-tokens` prompt
(no prefix-cache hits) generating `--max-tokens` tokens. Every engine step is recorded: its decodes,
prefill tokens and chunks, its time, the kernels' share, and the engine thread's whole cycle from the
previous step's end (scheduling and output processing included) — the gap a stream that decoded in
both steps sees between its tokens. The report gives those gaps weighted by the decodes of each step,
split by whether a prefill shared the step, and how the prefill steps' sizes relate to their time.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.serve import machine_description, synthetic_prompt
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.engine.runner import ModelRunner
from decoding.engine.step import ScheduledStep
from decoding.kernels.phases import PHASES
from decoding.model.registry import DEFAULT_MODEL, load_model


@dataclass(slots=True)
class StepRecord:
    ended: float  # time.perf_counter() when the engine reported the step
    cycle_ms: float  # since the previous step's end: what a stream decoding in both sees between tokens
    step_ms: float  # the step itself: batch, model, sampling, publishing
    kernel_ms: float  # of which the model's kernels
    decodes: int
    draft_tokens: int
    prefill_tokens: int
    prefill_chunks: int
    largest_chunk: int
    phase_cycles: list[int] | None = None  # cycles of each of PHASES in this step, where profiled


class StepRecorder:
    """An engine observer keeping a record of every step (engine thread; appends only).

    Given a runner that profiles its phases, each record also holds the step's cycles per phase.
    """

    def __init__(self, runner: ModelRunner | None = None) -> None:
        self.records: list[StepRecord] = []
        self._last_end: float | None = None
        self._runner = runner
        self._phases_before: np.ndarray | None = None

    def on_step_scheduled(self, scheduled: ScheduledStep, seconds: float, kernel_seconds: float) -> None:
        now = time.perf_counter()
        decodes = scheduled.num_decode_tokens - scheduled.num_draft_tokens
        # a decode is one token (plus its drafts); the other chunks are prefills, the largest ones
        undrafted = sorted((c.num_tokens for c in scheduled.chunks if c.num_draft_tokens == 0), reverse=True)
        prefill = undrafted[: len(scheduled.chunks) - decodes]
        cycle = (now - self._last_end) if self._last_end is not None else seconds
        self._last_end = now
        self.records.append(StepRecord(now, 1e3 * cycle, 1e3 * seconds, 1e3 * kernel_seconds, decodes,
                                       scheduled.num_draft_tokens, sum(prefill), len(prefill), max(prefill, default=0),
                                       self._step_phases()))

    def _step_phases(self) -> list[int] | None:
        total = self._runner.phase_cycles if self._runner is not None else None
        if total is None:
            return None
        before = self._phases_before if self._phases_before is not None else np.zeros_like(total)
        self._phases_before = total.copy()
        return (total - before).tolist()


def phase_summary(records: list[StepRecord]) -> dict[str, Any] | None:
    """Each phase's share of the kernels' time and its milliseconds in a mean step, for decode-only
    steps and for those a prefill shared (None where the steps were not profiled)."""
    profiled = [r for r in records if r.phase_cycles is not None]
    if not profiled:
        return None

    def split(rows: list[StepRecord]) -> dict[str, Any]:
        if not rows:
            return {"steps": 0, "kernel_ms": float("nan"), "phases": {}}
        cycles = np.sum([r.phase_cycles for r in rows], axis=0, dtype=np.float64)
        shares = cycles / max(1.0, cycles.sum())
        kernel_ms = float(np.mean([r.kernel_ms for r in rows]))
        return {"steps": len(rows), "kernel_ms": kernel_ms,
                "phases": {name: {"share": float(share), "ms": float(share * kernel_ms)}
                           for name, share in zip(PHASES, shares, strict=True)}}

    return {"decode_only": split([r for r in profiled if r.decodes and not r.prefill_tokens]),
            "with_prefill": split([r for r in profiled if r.prefill_tokens])}


def weighted_percentiles(values: list[float], weights: list[int], percentiles: tuple[float, ...]) -> list[float]:
    """Percentiles of `values` where each counts `weights` times (a step's gap, once per decode in it)."""
    if not values:
        return [float("nan")] * len(percentiles)
    order = np.argsort(values)
    sorted_values = np.asarray(values, dtype=np.float64)[order]
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    return [float(sorted_values[min(np.searchsorted(cumulative, p / 100 * cumulative[-1]), len(values) - 1)])
            for p in percentiles]


def gap_summary(records: list[StepRecord]) -> dict[str, Any]:
    """Gaps between tokens as decoding streams see them: each step's cycle once per decode in it."""
    with_decodes = [r for r in records if r.decodes]

    def summary(rows: list[StepRecord]) -> dict[str, Any]:
        p50, p90, p99, p999 = weighted_percentiles([r.cycle_ms for r in rows], [r.decodes for r in rows],
                                                   (50, 90, 99, 99.9))
        return {"steps": len(rows), "tokens": sum(r.decodes for r in rows), "p50_ms": p50, "p90_ms": p90,
                "p99_ms": p99, "p999_ms": p999}

    prefill_steps = [r for r in with_decodes if r.prefill_tokens]
    return {"all": summary(with_decodes), "decode_only": summary([r for r in with_decodes if not r.prefill_tokens]),
            "with_prefill": summary(prefill_steps),
            "prefill_tokens_per_prefill_step": {
                "p50": float(np.median([r.prefill_tokens for r in prefill_steps])) if prefill_steps else None,
                "max": max((r.prefill_tokens for r in prefill_steps), default=None)},
            "python_share": 1 - sum(r.kernel_ms for r in records) / max(1e-9, sum(r.cycle_ms for r in records))}


def run_churn(engine: Engine, prompts: list[list[int]], streams: int, seconds: float, max_tokens: int,
              ramp_seconds: float = 3.0, phases: bool = False) -> tuple[list[StepRecord], int]:
    """The closed loop; the records of the steps after the ramp, and the requests completed in them.

    `phases`: time every phase of each step (decoding.kernels.phases) while recording.
    """
    recorder = StepRecorder(engine.runner if phases else None)
    stop_at = time.perf_counter() + ramp_seconds + seconds
    next_prompt = iter(range(len(prompts)))
    lock = threading.Lock()
    completed = [0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def slot() -> None:
        while time.perf_counter() < stop_at:
            with lock:
                index = next(next_prompt, None)
            if index is None:
                return
            for _ in engine.submit(prompts[index], params):
                pass
            with lock:
                completed[0] += 1

    threads = [threading.Thread(target=slot) for _ in range(streams)]
    for thread in threads:
        thread.start()
    time.sleep(ramp_seconds)
    if phases:
        engine.runner.profile_phases(True)
    engine.observers.append(recorder)
    completed[0] = 0
    time.sleep(max(0.0, stop_at - time.perf_counter()))
    engine.observers.remove(recorder)
    engine.runner.profile_phases(False)
    for thread in threads:
        thread.join()
    return recorder.records, completed[0]


def print_report(report: dict[str, Any]) -> None:
    gaps = report["gaps"]
    print(f"{report['streams']} streams, closed loop, unique ~{report['prompt_tokens']}-token prompts, "
          f"{report['max_tokens']} tokens each: {report['output_tokens_per_second']:.0f} output tokens/s over "
          f"{report['seconds']:.0f} s, {report['steps']} steps, {report['requests_completed']} requests completed")
    print(f"{'gaps between tokens (ms)':<34}{'steps':>7}{'tokens':>8}{'p50':>8}{'p90':>8}{'p99':>8}{'p99.9':>8}")
    for name in ("all", "decode_only", "with_prefill"):
        g = gaps[name]
        print(f"{name.replace('_', ' '):<34}{g['steps']:>7}{g['tokens']:>8}{g['p50_ms']:>8.1f}{g['p90_ms']:>8.1f}"
              f"{g['p99_ms']:>8.1f}{g['p999_ms']:>8.1f}")
    share = gaps["with_prefill"]["tokens"] / max(1, gaps["all"]["tokens"])
    print(f"{100 * share:.0f}% of the tokens came from steps a prefill shared; prefill tokens in such a step: "
          f"median {gaps['prefill_tokens_per_prefill_step']['p50']}, "
          f"max {gaps['prefill_tokens_per_prefill_step']['max']}")
    print(f"Python (everything but the kernels) {100 * gaps['python_share']:.0f}% of the engine thread's time")
    phases = report.get("phases")
    if phases:
        plain, shared = phases["decode_only"], phases["with_prefill"]
        print(f"{'kernel time by phase':<34}{'decode-only steps':>24}{'steps with a prefill':>24}")
        print(f"{'mean kernel ms a step':<34}{plain['kernel_ms']:>24.2f}{shared['kernel_ms']:>24.2f}")
        for name in PHASES:
            cells = [f"{d['phases'][name]['ms']:.2f} ms {100 * d['phases'][name]['share']:4.1f}%"
                     if name in d["phases"] else "—" for d in (plain, shared)]
            print(f"{name:<34}{cells[0]:>24}{cells[1]:>24}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench churn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured, after a 3 s ramp")
    parser.add_argument("--prompt-tokens", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-itl-stretch", type=float, default=EngineConfig().max_itl_stretch,
                        help="the scheduler's step-time bound while streams decode (default %(default)s)")
    parser.add_argument("--phases", action="store_true",
                        help="time each phase of every step (the kernels' barriers) and print where the time goes")
    parser.add_argument("--json", dest="json_path", help="write the report and every step record here")
    args = parser.parse_args(argv)

    model = load_model(args.model)
    rng = random.Random(0)
    prompts = [model.tokenizer.encode(synthetic_prompt(args.prompt_tokens, rng, i)) for i in range(20000)]
    config = EngineConfig(n_threads=args.threads, max_num_seqs=max(64, args.streams),
                          max_itl_stretch=args.max_itl_stretch)
    engine = Engine(model, config).start()
    try:
        engine.generate(prompts[-1], SamplingParams(max_tokens=4, temperature=0))  # compile, warm
        records, completed = run_churn(engine, prompts[:-1], args.streams, args.seconds, args.max_tokens,
                                       phases=args.phases)
    finally:
        engine.shutdown()
    span = records[-1].ended - records[0].ended + records[0].cycle_ms / 1e3 if records else float("nan")
    report = {"model": model.name, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "seconds": span, "steps": len(records),
              "requests_completed": completed, "max_itl_stretch": args.max_itl_stretch,
              "output_tokens_per_second": sum(r.decodes + r.draft_tokens for r in records) / span,
              "gaps": gap_summary(records), "phases": phase_summary(records), "machine": machine_description(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    print_report(report)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({**report, "records": [asdict(r) for r in records]}, f, indent=1)
    return 0
