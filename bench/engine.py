"""`treadle bench engine`: the engine in process on the default model — decode speed alone and batched,
prefill speed, where a step's time goes, and the rooflines measured in the same run.

    treadle bench engine [--concurrency 1,4,16,32,64] [--max-tokens 128] [--peers] [--json PATH]

--peers then measures llama.cpp and transformers, each in its own process after treadle's figures are
taken, on the same GGUF and thread count.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from bench.engine_peers import run_llama_cpp, run_peers
from bench.engine_quality import measure_quality
from bench.engine_report import print_table
from bench.engine_rooflines import flops_per_token as token_flops
from bench.engine_rooflines import (
    measure_gemm_gflops,
    measure_int8_gmacs,
    measure_numpy_read_bandwidth,
    measure_read_bandwidth,
    measure_triad_bandwidth,
    vnni_issue_gmacs,
)
from bench.engine_streams import generate_together
from bench.speculative import measure_speculative
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.engine.structured import Constraint
from decoding.kernels.forward import KERNEL_MODES, int8_kernels
from decoding.model.model import Model
from decoding.model.registry import DEFAULT_MODEL, load_model

PROMPT = ("The history of weaving goes back thousands of years. Looms were among the first machines, and "
          "the treadle let a weaver lift the warp threads with a foot while both hands threw the shuttle.")


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    step_ms_median: float
    python_share: float  # of step time, outside the pool kernel


class StepTimer:
    """Engine observer: per-step wall and kernel time."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    def on_step(self, seconds: float, kernel_seconds: float, num_tokens: int, num_seqs: int) -> None:
        self.steps.append((seconds, kernel_seconds))

    def on_first_token(self, seconds: float) -> None: ...
    def on_request_finished(self, request: object, finish_reason: str) -> None: ...
    def on_preemption(self) -> None: ...


def run_level(engine: Engine, prompt_ids: list[int], concurrency: int, max_tokens: int,
              constraint: Constraint | None = None) -> LevelResult:
    timer = StepTimer()
    engine.observers.append(timer)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=constraint is None,
                             constraint=constraint) for i in range(concurrency)]  # fmt: skip
    total, seconds = generate_together(engine, prompt_ids, params)
    engine.observers.remove(timer)
    decode_steps = timer.steps[1:] or timer.steps  # the first step is the prompts' prefill
    step_seconds = [s for s, _ in decode_steps]
    python = sum(s - k for s, k in decode_steps) / max(sum(step_seconds), 1e-12)
    return LevelResult(concurrency, total, seconds, total / seconds, 1000 * statistics.median(step_seconds), python)


@dataclass(slots=True)
class InterferenceResult:
    streams: int
    long_prompt_tokens: int
    median_gap_ms: float  # between tokens of the running streams, before the long prompt arrived
    median_gap_after_ms: float  # the same right after its prefill: the streams' contexts have grown meanwhile
    max_gap_ms: float  # the longest gap while it was prefilled
    p99_gap_ms: float
    stretch: float  # max gap / median gap
    long_prompt_ttft_s: float


def measure_long_prompt_interference(engine: Engine, model: Model, num_streams: int,
                                     long_tokens: int) -> InterferenceResult:
    """Streams decode; a long prompt arrives: how much does its prefill stretch their token gaps?"""
    prompt_ids = model.tokenizer.encode(PROMPT)
    arrivals: list[list[float]] = [[] for _ in range(num_streams)]
    streams = [engine.submit(prompt_ids, SamplingParams(max_tokens=4000, temperature=0.8, seed=i, ignore_eos=True),
                             request_id=f"stream-{i}") for i in range(num_streams)]

    def read(i: int) -> None:
        for out in streams[i]:
            arrivals[i].extend([time.perf_counter()] * len(out.token_ids))

    readers = [threading.Thread(target=read, args=(i,)) for i in range(num_streams)]
    for t in readers:
        t.start()
    while min(len(a) for a in arrivals) < 24:
        time.sleep(0.01)
    injected = time.perf_counter()
    rng = np.random.default_rng(1)
    engine.generate(rng.integers(100, model.config.vocab_size, long_tokens).tolist(), SamplingParams(max_tokens=1))
    prefilled = time.perf_counter()
    time.sleep(1.0)
    for i in range(num_streams):
        engine.abort(f"stream-{i}")
    for t in readers:
        t.join()
    before, during, after = [], [], []
    for times in arrivals:
        for previous, current in itertools.pairwise(times[8:]):  # skip each stream's own prefill
            if current <= injected:
                before.append(current - previous)
            elif current <= prefilled + 0.05:
                during.append(current - previous)
            elif previous >= prefilled + 0.05:
                after.append(current - previous)
    median = statistics.median(g for g in before if g > 0)
    median_after = statistics.median(g for g in after if g > 0) if any(g > 0 for g in after) else float("nan")
    largest = max(during)
    return InterferenceResult(num_streams, long_tokens, 1000 * median, 1000 * median_after, 1000 * largest,
                              1000 * float(np.percentile(during, 99)), largest / median, prefilled - injected)


STRUCTURED_PROMPT = "Here is a customer record of our shop, as JSON: "
# ~10 fields, bounded so that every answer ends by itself (a record a form or an agent might ask for)
STRUCTURED_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": r"^[a-z]{1,12}@[a-z]{1,12}\.com$"},
        "city": {"type": "string", "maxLength": 16}, "country": {"enum": ["FR", "DE", "US", "JP", "BR"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "joined": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
    },
}  # fmt: skip
STRUCTURED_SCHEMA["required"] = list(STRUCTURED_SCHEMA["properties"])


@dataclass(slots=True)
class ClosedLoopResult:
    concurrency: int
    tokens_per_second: float  # counted in the window, while every slot was busy
    step_ms_median: float
    mean_answer_tokens: float  # of the requests that finished


def run_closed_loop(engine: Engine, prompt_ids: list[int], concurrency: int, seconds: float,
                    make_params: Callable[[int], SamplingParams]) -> ClosedLoopResult:
    """`concurrency` slots, each submitting its next request as soon as the last one ends (a server's
    steady state, whatever the answers' lengths), for `seconds` after a ramp (the first answers)."""
    timer = StepTimer()
    started = time.perf_counter()
    ramp = 0.3 if concurrency == 1 else 1.0
    window = (started + ramp, started + ramp + seconds)
    tokens_in_window = [0] * concurrency
    answers: list[int] = []

    def slot(i: int) -> None:
        n = 0
        while time.perf_counter() < window[1]:
            count = 0
            for out in engine.submit(prompt_ids, make_params(1000 * i + n)):
                count += len(out.token_ids)
                if window[0] <= time.perf_counter() < window[1]:
                    tokens_in_window[i] += len(out.token_ids)
            answers.append(count)
            n += 1

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, window[0] - time.perf_counter()))
    engine.observers.append(timer)
    time.sleep(max(0.0, window[1] - time.perf_counter()))
    engine.observers.remove(timer)
    for t in threads:
        t.join()
    return ClosedLoopResult(concurrency, sum(tokens_in_window) / seconds,
                            1000 * statistics.median(s for s, _ in timer.steps),
                            statistics.mean(answers) if answers else float("nan"))


def measure_structured(engine: Engine, model: Model, levels: list[int], rounds: int = 8) -> dict:
    """Each level in a closed loop constrained by STRUCTURED_SCHEMA and unconstrained (answers as long
    as the constrained ones were on average), alternated `rounds` times; the ratio is the median of
    the rounds' ratios (each pair ran within seconds of each other: a shared machine's drift cancels),
    with the medians of each side; and the schema's compile time."""
    prompt_ids = model.tokenizer.encode(STRUCTURED_PROMPT)
    constraint = Constraint("json", json.dumps(STRUCTURED_SCHEMA))
    engine.generate(prompt_ids, SamplingParams(max_tokens=4, constraint=Constraint("json_object")))  # load llguidance
    started = time.perf_counter()
    engine.guide.compile(constraint)
    compile_ms = 1000 * (time.perf_counter() - started)
    results = []
    for level in levels:
        seconds = 1.5 if level == 1 else 4.0  # several answers per slot at this level's speed
        sides: dict[str, list[ClosedLoopResult]] = {"constrained": [], "unconstrained": []}
        for _ in range(rounds):
            sides["constrained"].append(run_closed_loop(engine, prompt_ids, level, seconds, lambda seed: SamplingParams(
                max_tokens=256, temperature=0.8, seed=seed, constraint=constraint)))
            length = max(1, round(statistics.mean(r.mean_answer_tokens for r in sides["constrained"])))
            sides["unconstrained"].append(run_closed_loop(
                engine, prompt_ids, level, seconds, lambda seed, length=length: SamplingParams(
                    max_tokens=length, temperature=0.8, seed=seed, ignore_eos=True)))
        ratios = [c.tokens_per_second / u.tokens_per_second for c, u in zip(*sides.values(), strict=True)]
        step_ratios = [c.step_ms_median / u.step_ms_median for c, u in zip(*sides.values(), strict=True)]
        medians = {side: {"tokens_per_second": statistics.median(r.tokens_per_second for r in runs),
                          "step_ms_median": statistics.median(r.step_ms_median for r in runs)}
                   for side, runs in sides.items()}
        results.append({"concurrency": level, "rounds": rounds, "window_seconds": seconds, **medians,
                        "per_round": {side: [asdict(r) for r in runs] for side, runs in sides.items()},
                        "round_ratios": ratios, "ratio": statistics.median(ratios),
                        "step_ms_ratio": statistics.median(step_ratios)})
    return {"schema_fields": len(STRUCTURED_SCHEMA["properties"]), "compile_ms": compile_ms, "levels": results}


def measure_prefill(engine: Engine, model: Model, num_tokens: int) -> float:
    """Prompt tokens per second on a fresh prompt of `num_tokens` (no prefix-cache hits)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(100, model.config.vocab_size, num_tokens).tolist()
    started = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    return num_tokens / (time.perf_counter() - started)


def alternate_with_llama_cpp(model: Model, config: EngineConfig, prompt_ids: list[int], max_tokens: int,
                             prefill_tokens: int, rounds: int) -> dict:
    """treadle (a fresh engine, warmed, then shut down so its pool leaves the cores) and llama.cpp (its own
    process) one after the other, `rounds` times: single-stream decode and prompt speed of each, and the
    ratio of their medians. Alternating puts both sides into every stretch of a shared machine's drift."""
    sides: dict[str, list[float]] = {"treadle_decode": [], "treadle_prompt": [], "llama_cpp_decode": [],
                                     "llama_cpp_prompt": []}  # fmt: skip
    for _ in range(rounds):
        engine = Engine(model, config).start()
        try:
            engine.generate(prompt_ids, SamplingParams(max_tokens=4))
            sides["treadle_decode"].append(run_level(engine, prompt_ids, 1, max_tokens).tokens_per_second)
            engine.kv.enable_prefix_caching = False
            sides["treadle_prompt"].append(measure_prefill(engine, model, prefill_tokens))
        finally:
            engine.shutdown()
        peer = run_llama_cpp(model, engine.pool.n_threads, None)
        if "skipped" in peer:
            return {"skipped": peer["skipped"]}
        sides["llama_cpp_decode"].append(peer["decode_tokens_per_second"])
        sides["llama_cpp_prompt"].append(peer["prompt_tokens_per_second"])
    medians = {name: float(np.median(values)) for name, values in sides.items()}
    return {"rounds": rounds, **sides, "medians": medians,
            "decode_ratio": medians["treadle_decode"] / medians["llama_cpp_decode"],
            "prompt_ratio": medians["treadle_prompt"] / medians["llama_cpp_prompt"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", choices=KERNEL_MODES, default="fast")
    parser.add_argument("--interference-streams", type=int, default=16,
                        help="streams decoding while a long prompt arrives (0 skips that measurement)")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--quality-tokens", type=int, default=3000,
                        help="positions of real text for the fast-vs-exact agreement (0 skips it)")
    parser.add_argument("--peers", action="store_true",
                        help="also measure llama.cpp (llama-cpp-python, .venv) and transformers (torch CPU, "
                             ".venv-bench) on the same GGUF and thread count")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --peers: then alternate treadle's single stream and prompt with llama.cpp's this "
                             "many times, each alone on the cores, and report the medians (a shared machine's "
                             "speed drifts from one minute to the next)")
    parser.add_argument("--structured", default="1,32",
                        help="levels run constrained by a ~10-field JSON schema beside unconstrained ones ('' skips)")
    parser.add_argument("--speculative", default="",
                        help="levels (e.g. 1,4,32) at which the edit, quote and chat workloads run with speculative "
                             "decoding off and auto ('' skips; the rest of the bench runs with it off)")
    parser.add_argument("--speculative-tokens", type=int, default=256, help="tokens per request of those workloads")
    parser.add_argument("--speculative-rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    model = load_model(args.model)
    prompt_ids = model.tokenizer.encode(PROMPT)
    structured_levels = [int(c) for c in args.structured.split(",")] if args.structured else []
    speculative_levels = [int(c) for c in args.speculative.split(",")] if args.speculative else []
    # +1: the long prompt
    max_seqs = max(*levels, *structured_levels, *speculative_levels, args.interference_streams + 1)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(512, max_seqs),
                          kv_cache_mb=1024, n_threads=args.threads, kernels=args.kernels, speculative="off")
    engine = Engine(model, config).start()
    try:
        engine.generate(prompt_ids, SamplingParams(max_tokens=4))  # warm-up: numba compiles or loads its cache
        gc.collect()
        gc.freeze()  # as `treadle serve` does once warm: long-lived objects stay out of full collections
        results = []
        for level in levels:
            result = run_level(engine, prompt_ids, level, args.max_tokens)
            results.append(result)
            print(f"  {level:>3} streams: {result.tokens_per_second:8.1f} tokens/s", flush=True)
        structured = measure_structured(engine, model, structured_levels) if structured_levels else None
        speculative = (measure_speculative(engine, model, speculative_levels, args.speculative_tokens,
                                           args.speculative_rounds) if speculative_levels else None)  # fmt: skip
        engine.kv.enable_prefix_caching = False
        prefill = measure_prefill(engine, model, args.prefill_tokens)
        interference = None
        if args.interference_streams:
            interference = measure_long_prompt_interference(engine, model, args.interference_streams,
                                                            args.long_prompt_tokens)
    finally:
        engine.shutdown()
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the probes below
    threads = engine.pool.n_threads
    quality = measure_quality(model, args.quality_tokens) if args.quality_tokens else None
    peers = (run_peers(model, threads, quality, prompt_ids, args.max_tokens, args.prefill_tokens)
             if args.peers else {})
    rounds = (alternate_with_llama_cpp(model, config, prompt_ids, args.max_tokens, args.prefill_tokens, args.rounds)
              if args.peers and args.rounds > 1 else None)
    bandwidth = measure_read_bandwidth(threads)
    numpy_bandwidth = measure_numpy_read_bandwidth(threads)
    triad_bandwidth = measure_triad_bandwidth(threads)
    gflops = measure_gemm_gflops()
    int8_gmacs = measure_int8_gmacs(model, threads) if int8_kernels(args.kernels) else None
    weight_bytes = model.weights.nbytes
    flops_per_token = token_flops(model)
    bandwidth_roofline = bandwidth * 1e9 / weight_bytes
    report = {
        "model": model.name,
        "threads": threads,
        "quality": {k: v for k, v in quality.items() if k not in ("chunks", "exact_top1")} if quality else None,
        "llama_cpp": peers.get("llama_cpp"),
        "transformers": peers.get("transformers"),
        "prompt_tokens": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "levels": [asdict(r) for r in results],
        "single_stream_tokens_per_second": results[0].tokens_per_second if levels[0] == 1 else None,
        "prefill_tokens_per_second": prefill,
        "prefill_prompt_tokens": args.prefill_tokens,
        "kernels": args.kernels,
        "long_prompt_interference": asdict(interference) if interference else None,
        "read_bandwidth_gb_s": bandwidth,
        "numpy_read_bandwidth_gb_s": numpy_bandwidth,
        "triad_bandwidth_gb_s": triad_bandwidth,
        "vnni_issue_gmacs": vnni_issue_gmacs(threads),
        "gemm_gflops": gflops,
        "weight_bytes_per_step": weight_bytes,
        "flops_per_token": flops_per_token,
        "bandwidth_roofline_tokens_per_second": bandwidth_roofline,
        "compute_roofline_tokens_per_second": gflops * 1e9 / flops_per_token,
        "int8_gmacs": int8_gmacs,
        "int8_roofline_tokens_per_second": int8_gmacs * 2e9 / flops_per_token if int8_gmacs else None,
        "peak_rss_mb": peak_rss_mb,
        "kv_cache_mb": config.kv_cache_mb,
        "model_file_mb": model.path.stat().st_size / 2**20,
        "rounds": rounds,
        "structured": structured,
        "speculative": speculative,
    }
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
