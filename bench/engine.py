"""`treadle bench engine`: the engine in process on the default model — decode speed alone and batched,
prefill speed, where a step's time goes, and the rooflines measured in the same run.

    treadle bench engine [--concurrency 1,4,16,32,64] [--max-tokens 128] [--peers] [--json PATH]

--peers then measures llama.cpp and transformers, each in its own process after treadle's figures are
taken, on the same GGUF and thread count.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from numba import njit

from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.kernels.fast_kernels import matmul_groups, quantize_activation_row
from decoding.kernels.kernels import split_range
from decoding.kernels.repack import is_packable, repack
from decoding.model.model import Model
from decoding.model.registry import DEFAULT_MODEL, load_model
from threadpool import SpinPool, barrier_wait

REPO = Path(__file__).resolve().parent.parent
# transformers lives in its own venv (`make bench`) so torch never enters .venv.
BENCH_PYTHON = REPO / ".venv-bench" / "bin" / "python"
# transformers' batched decode is taken at one size, treadle's 32-stream level: torch on two cores
# needs a minute or more for each batch size.
TRANSFORMERS_BATCH = 32
PEER_TIMEOUT_S = 1800

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


def run_level(engine: Engine, prompt_ids: list[int], concurrency: int, max_tokens: int) -> LevelResult:
    timer = StepTimer()
    engine.observers.append(timer)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True) for i in range(concurrency)]
    counts = [0] * concurrency
    started = time.perf_counter()
    streams = [engine.submit(prompt_ids, p) for p in params]

    def drain(i: int) -> None:
        counts[i] = sum(len(o.token_ids) for o in streams[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    engine.observers.remove(timer)
    decode_steps = timer.steps[1:] or timer.steps  # the first step is the prompts' prefill
    step_seconds = [s for s, _ in decode_steps]
    python = sum(s - k for s, k in decode_steps) / max(sum(step_seconds), 1e-12)
    total = sum(counts)
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


def quality_corpus(model: Model, num_tokens: int, chunk: int = 512) -> list[list[int]]:
    """Real English text (the standard library's module documentation), cut in chunks of token ids."""
    names = ("argparse", "json", "logging", "textwrap", "typing", "unittest", "email", "collections", "inspect",
             "pickle")
    text = "\n\n".join(importlib.import_module(name).__doc__ or "" for name in names)
    ids = model.tokenizer.encode(text)[:num_tokens]
    return [ids[i : i + chunk] for i in range(0, len(ids) - 1, chunk)]


def top1_predictions(engine: Engine, chunks: list[list[int]]) -> list[list[int]]:
    """The model's argmax after every position of every chunk (prompt logprobs, then the sampled token)."""
    result = []
    for ids in chunks:
        out = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        result.append([lp.top[0][0] for lp in out.prompt_logprobs[1:]] + [out.token_ids[0]])
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(x == y for x, y in pairs) / len(pairs)


def measure_quality(model: Model, num_tokens: int) -> dict:
    """Fast kernels against exact ones: top-1 agreement over real text and greedy continuations."""
    chunks = quality_corpus(model, num_tokens)
    predictions, greedy = {}, {}
    prompts = [ids[:48] for ids in chunks]
    for kernels in ("exact", "fast"):
        engine = Engine(model, EngineConfig(kv_cache_mb=256, kernels=kernels, enable_prefix_caching=False)).start()
        try:
            predictions[kernels] = top1_predictions(engine, chunks)
            greedy[kernels] = [engine.generate(p, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
                               .token_ids for p in prompts]
        finally:
            engine.shutdown()
    identical = sum(a == b for a, b in zip(greedy["fast"], greedy["exact"]))
    return {"positions": sum(len(c) for c in chunks), "chunks": chunks, "exact_top1": predictions["exact"],
            "fast_top1_agreement": agreement(predictions["fast"], predictions["exact"]),
            "greedy_prompts": len(prompts), "greedy_identical_32_tokens": identical,
            "greedy_token_agreement": agreement(greedy["fast"], greedy["exact"])}


def peer_result(peer: str, returncode: int, stdout: str, stderr: str) -> dict:
    """A peer script's report, the JSON on its last stdout line, or why there is none (the tail of its
    stderr, where a traceback ends): a failed peer becomes a line of the report instead of losing the
    treadle figures measured before it."""
    lines = stdout.strip().splitlines()
    if returncode != 0 or not lines:
        return {"skipped": f"{peer} peer failed (exit {returncode}): {stderr.strip()[-300:]}"}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"skipped": f"{peer} peer printed no JSON: {lines[-1][-300:]}"}


def run_peer(peer: str, command: list[str]) -> dict:
    """Runs a peer script to its end: the caller runs peers one after the other, never beside treadle."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PEER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"skipped": f"{peer} peer ran past {PEER_TIMEOUT_S} s"}
    return peer_result(peer, done.returncode, done.stdout, done.stderr)


def run_llama_cpp(model: Model, threads: int, quality: dict | None) -> dict:
    """llama.cpp in its own process on the same GGUF file and thread count (bench/llama_cpp_peer.py)."""
    script = REPO / "bench" / "llama_cpp_peer.py"
    if not script.exists() or model.path.suffix != ".gguf":
        return {"skipped": "needs a checkout with bench/ and a GGUF model"}
    command = [sys.executable, str(script), "--model", str(model.path), "--threads", str(threads)]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as ids_file:
        if quality:
            json.dump(quality["chunks"], ids_file)
            ids_file.flush()
            command += ["--agreement-ids", ids_file.name]
        result = run_peer("llama.cpp", command)
    if quality and "argmax" in result:
        result["top1_agreement_with_exact"] = agreement(result.pop("argmax"), quality["exact_top1"])
    return result


def run_transformers(gguf: Path, model_name: str, threads: int, prompt_ids: list[int], max_tokens: int,
                     prefill_tokens: int, python: Path = BENCH_PYTHON) -> dict:
    """transformers (torch CPU, float32) in .venv-bench's Python on the same weights and thread count, the
    same prompt ids and lengths as treadle's figures (bench/transformers_peer.py)."""
    script = REPO / "bench" / "transformers_peer.py"
    if not script.exists() or gguf.suffix != ".gguf":
        return {"skipped": "needs a checkout with bench/ and a GGUF model"}
    if not python.exists():
        return {"skipped": f"not installed: {python} does not exist; run make bench"}
    hf_dir = REPO / "bench-results" / f"hf-{model_name}"  # the directory bench/side_by_side.py serves
    return run_peer("transformers", [
        str(python), str(script), "--model", str(gguf), "--hf-dir", str(hf_dir), "--threads", str(threads),
        "--prompt-ids", ",".join(map(str, prompt_ids)), "--max-new-tokens", str(max_tokens),
        "--batch-sizes", str(TRANSFORMERS_BATCH), "--prefill-tokens", str(prefill_tokens)])


def run_peers(model: Model, threads: int, quality: dict | None, prompt_ids: list[int], max_tokens: int,
              prefill_tokens: int) -> dict[str, dict]:
    """One peer after the other, so none shares the cores with another (or with treadle)."""
    return {"llama_cpp": run_llama_cpp(model, threads, quality),
            "transformers": run_transformers(model.path, model.name, threads, prompt_ids, max_tokens,
                                             prefill_tokens)}


def measure_prefill(engine: Engine, model: Model, num_tokens: int) -> float:
    """Prompt tokens per second on a fresh prompt of `num_tokens` (no prefix-cache hits)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(100, model.config.vocab_size, num_tokens).tolist()
    started = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    return num_tokens / (time.perf_counter() - started)


@njit(nogil=True, cache=True)
def _read_share(tid, nthreads, barrier, data, sums):  # type: ignore[no-untyped-def]
    """Sum this thread's share of `data` in independent lanes (a vectorised pure read)."""
    begin, end = split_range(data.shape[0] // 16, tid, nthreads)
    lanes = np.zeros(16, dtype=np.float32)
    for i in range(begin, end):
        for lane in range(16):
            lanes[lane] += data[16 * i + lane]
    sums[tid] = lanes.sum()
    barrier_wait(barrier, tid)


def measure_read_bandwidth(threads: int) -> float:
    """GB/s reading 1 GiB of float32 on the pool's threads, each its own half: the memory roofline
    for a decode step, which streams every weight once split over the same threads."""
    data = np.ones(256 * 1024 * 1024, dtype=np.float32)
    sums = np.zeros(threads, dtype=np.float32)
    best = 0.0
    with SpinPool(threads) as pool:
        pool.run(_read_share, data[: 1 << 16], sums)  # compile or load the kernel
        for _ in range(3):
            started = time.perf_counter()
            pool.run(_read_share, data, sums)
            best = max(best, data.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def measure_gemm_gflops() -> float:
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    a @ a
    started = time.perf_counter()
    for _ in range(4):
        a @ a
    return 4 * 2 * 1024**3 / (time.perf_counter() - started) / 1e9


@njit(nogil=True, cache=True)
def _int8_matmul_repeats(tid, nthreads, barrier, packed, qtype, n_rows, n_cols, xq, xd, xsum, n_tokens, out, tmp,
                         repeats):  # fmt: skip
    g0, g1 = split_range(n_rows // 8, tid, nthreads)
    for _ in range(repeats):
        matmul_groups(packed, qtype, n_cols, xq, xd, xsum, n_tokens, out, g0, g1, False, tmp[tid])
        barrier_wait(barrier, tid)


def measure_int8_gmacs(model: Model, threads: int, tokens: int = 32) -> float | None:
    """Multiply-accumulates per second of the fast kernels on the pool, weights in cache: the compute
    ceiling of a batched step (a 32-sequence decode step is int8 dot products, not memory traffic).

    One feed-forward matrix of the model (repacked, a few hundred KB: it stays in L2), `tokens`
    activation rows, split over the threads as a step splits it. None when the matrix is not packable.
    """
    matrix = model.weights.layers[0].w_up
    if not is_packable(matrix.qtype, matrix.n_rows):
        return None
    rows, cols = matrix.n_rows, matrix.n_cols
    packed = repack(matrix.data, matrix.qtype, rows, cols)
    x = np.random.default_rng(0).standard_normal((tokens, cols)).astype(np.float32)
    xq = np.zeros((tokens, cols), np.int8)
    xd = np.zeros((tokens, cols // 32), np.float32)
    xsum = np.zeros((tokens, cols // 32), np.int32)
    for t in range(tokens):
        quantize_activation_row(x[t], cols, xq[t], xd[t], xsum[t])
    out = np.zeros((tokens, rows), np.float32)
    tmp = np.zeros((threads, 4, 8), np.float32)
    repeats = 50
    best = float("inf")
    with SpinPool(threads) as pool:
        args = (packed, int(matrix.qtype), rows, cols, xq, xd, xsum, tokens, out, tmp)
        pool.run(_int8_matmul_repeats, *args, 1)  # compile or load, warm the caches
        for _ in range(5):
            started = time.perf_counter()
            pool.run(_int8_matmul_repeats, *args, repeats)
            best = min(best, time.perf_counter() - started)
    return repeats * rows * cols * tokens / best / 1e9


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", choices=("fast", "exact"), default="fast")
    parser.add_argument("--interference-streams", type=int, default=16,
                        help="streams decoding while a long prompt arrives (0 skips that measurement)")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--quality-tokens", type=int, default=3000,
                        help="positions of real text for the fast-vs-exact agreement (0 skips it)")
    parser.add_argument("--peers", action="store_true",
                        help="also measure llama.cpp (llama-cpp-python, .venv) and transformers (torch CPU, "
                             ".venv-bench) on the same GGUF and thread count")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    model = load_model(args.model)
    prompt_ids = model.tokenizer.encode(PROMPT)
    max_seqs = max(*levels, args.interference_streams + 1)  # the long prompt must find a free slot
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(512, max_seqs),
                          kv_cache_mb=1024, n_threads=args.threads, kernels=args.kernels)
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
    bandwidth = measure_read_bandwidth(threads)
    gflops = measure_gemm_gflops()
    int8_gmacs = measure_int8_gmacs(model, threads) if args.kernels == "fast" else None
    weight_bytes = model.weights.nbytes
    flops_per_token = 2 * sum(m.n_rows * m.n_cols for layer in model.weights.layers
                              for m in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))
    flops_per_token += 2 * model.weights.lm_head.n_rows * model.weights.lm_head.n_cols
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
    }
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def print_table(r: dict) -> None:
    single = r["single_stream_tokens_per_second"]
    print(f"\n{r['model']} — {r['kernels']} kernels, {r['threads']} pool threads, {r['prompt_tokens']}-token prompts, "
          f"{r['max_tokens']} new tokens each")
    print(f"{'streams':>8} {'tokens/s':>10} {'× single':>9} {'step ms p50':>12} {'python share':>13}")
    for level in r["levels"]:
        ratio = f"{level['tokens_per_second'] / single:8.2f}×" if single else ""
        print(f"{level['concurrency']:>8} {level['tokens_per_second']:>10.1f} {ratio:>9} "
              f"{level['step_ms_median']:>12.2f} {100 * level['python_share']:>12.1f}%")
    print(f"\nprefill: {r['prefill_tokens_per_second']:.0f} tokens/s on a {r['prefill_prompt_tokens']}-token prompt")
    if r["long_prompt_interference"]:
        i = r["long_prompt_interference"]
        print(f"a {i['long_prompt_tokens']}-token prompt arriving while {i['streams']} streams decode: their token gap "
              f"{i['median_gap_ms']:.1f} ms median before, {i['max_gap_ms']:.1f} ms max / {i['p99_gap_ms']:.1f} ms p99 "
              f"during its prefill ({i['stretch']:.2f}× median); its first token after {i['long_prompt_ttft_s']:.2f} s")
        print(f"  (right after its prefill the streams' median gap was {i['median_gap_after_ms']:.1f} ms: their contexts "
              f"grew meanwhile; the p99 gap during it is {i['p99_gap_ms'] / i['median_gap_after_ms']:.2f}× that)")
    print(f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s on {r['threads']} threads → roofline {r['bandwidth_roofline_tokens_per_second']:.0f}"
          f" tokens/s for one stream ({r['weight_bytes_per_step'] / 1e6:.1f} MB of weights per step)")
    if single:
        print(f"single stream reaches {100 * single / r['bandwidth_roofline_tokens_per_second']:.0f}% of it")
    print(f"GEMM {r['gemm_gflops']:.0f} GFLOP/s → compute roofline {r['compute_roofline_tokens_per_second']:.0f}"
          f" tokens/s batched ({r['flops_per_token'] / 1e9:.2f} GFLOP per token)")
    if r.get("int8_gmacs"):
        print(f"int8 VNNI kernels {r['int8_gmacs']:.0f} GMAC/s on {r['threads']} threads (weights in cache, 32 rows) → "
              f"compute roofline {r['int8_roofline_tokens_per_second']:.0f} tokens/s for a batched decode step")
    if r["quality"]:
        q = r["quality"]
        print(f"fast vs exact kernels over {q['positions']} positions of real text: top-1 agrees at "
              f"{100 * q['fast_top1_agreement']:.1f}%; greedy 32-token continuations identical for "
              f"{q['greedy_identical_32_tokens']}/{q['greedy_prompts']} prompts "
              f"({100 * q['greedy_token_agreement']:.1f}% of tokens)")
    peer = r["llama_cpp"]
    if peer and "skipped" not in peer:
        single = r["single_stream_tokens_per_second"]
        print(f"llama.cpp {peer['llama_cpp_version']} ({peer['threads']} threads, same GGUF): decode "
              f"{peer['decode_tokens_per_second']:.1f} tokens/s"
              + (f" → treadle {single / peer['decode_tokens_per_second']:.2f}×" if single else "")
              + f"; prompt {peer['prompt_tokens_per_second']:.0f} tokens/s → treadle "
              f"{r['prefill_tokens_per_second'] / peer['prompt_tokens_per_second']:.2f}×")
        if "top1_agreement_with_exact" in peer:
            print(f"llama.cpp top-1 agrees with treadle's exact kernels at {100 * peer['top1_agreement_with_exact']:.1f}%")
    elif peer:
        print(f"llama.cpp: {peer['skipped']}")
    if r["transformers"]:
        print(format_transformers(r))
    print(f"peak RSS {r['peak_rss_mb']:.0f} MB (model file {r['model_file_mb']:.0f} MB, KV cache {r['kv_cache_mb']:.0f} MB)")


def format_transformers(r: dict) -> str:
    """treadle beside transformers: single-stream decode, aggregate decode at TRANSFORMERS_BATCH streams,
    prompt processing, and treadle / transformers (above 1: treadle is faster). treadle's decode figures
    are its levels', whose wall time includes their prompts' prefill; the peer's exclude it."""
    peer = r["transformers"]
    if "skipped" in peer:
        return f"transformers: {peer['skipped']}"
    level = next((lv for lv in r["levels"] if lv["concurrency"] == TRANSFORMERS_BATCH), None)
    rows = [("single-stream decode", r["single_stream_tokens_per_second"], peer["decode_tokens_per_second"]),
            (f"{TRANSFORMERS_BATCH} streams, aggregate", level["tokens_per_second"] if level else None,
             peer["batched_tokens_per_second"].get(str(TRANSFORMERS_BATCH))),
            (f"prompt, {r['prefill_prompt_tokens']} tokens", r["prefill_tokens_per_second"],
             peer["prompt_tokens_per_second"])]
    title = (f"transformers {peer['transformers_version']} (torch {peer['torch_version']}, {peer['dtype']}, "
             f"{peer['threads']} threads, the same weights), tokens/s:")
    lines = [title, f"{'':<26} {'treadle':>9} {'transformers':>13} {'treadle ×':>10}"]
    for name, ours, theirs in rows:
        ratio = f"{ours / theirs:.2f}×" if ours and theirs else "—"
        lines.append(f"{name:<26} {_figure(ours):>9} {_figure(theirs):>13} {ratio:>10}")
    return "\n".join(lines)


def _figure(tokens_per_second: float | None) -> str:
    return f"{tokens_per_second:.1f}" if tokens_per_second else "—"
