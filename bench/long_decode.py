"""`treadle bench long-decode FILE.gguf`: one decode step at long contexts, without their prefill.

    .venv/bin/treadle bench long-decode /tmp/shapes/qwen2.5-1.5b-q4_k_m.gguf --contexts 1024,8192,32768
        [--kv-dtypes float16,int8] [--threads 2] [--steps 12] [--block-size 16] [--json PATH]

The model's real step (`ModelRunner.forward`, the fast kernels on the spin pool, the weight cache
mapped) decodes one token at position C - 1 of a sequence whose C - 1 earlier positions' keys and
values already fill the KV cache: random values of the cache's storage type in the blocks a long
prefill leaves behind (consecutive ids), every layer its own. A step's time does not depend on the
values, so this measures what a server's decode costs at that context in seconds instead of the
minutes a 32k-token prefill takes. The contexts take turns step by step, so a ratio compares steps
taken at the same moments. Reported per context and KV type: the median step time (ms per output
token), its ratio to the shortest context's (each round's pair of steps divided, the median of those
ratios: a shared host's slow minutes slow both steps of a round), and the KV bytes one step reads
(a sliding-window layer's window only).
Beside them the roof: the read bandwidth the pool's own threads measure in the same run, the rate the
step reads the KV bytes a longer context adds (its extra bytes over its extra time), and the ratio a
step would have if it read them at that bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_rooflines import measure_read_bandwidth
from decoding import load_model
from decoding.engine.runner import ModelRunner, StepBatch
from decoding.kernels import weight_cache
from decoding.kernels.forward import KernelWeights
from decoding.model.config import ModelConfig
from kvcache.batch import KVBatchArrays
from kvcache.storage import KVCacheSpec, KVCacheStorage
from threadpool import SpinPool


def _fill_random(storage: KVCacheStorage, rng: np.random.Generator) -> None:
    """Values a real cache could hold, layer by layer: half floats of N(0, 1), or int8 values with
    every group's fp16 scale 1/127 (each value dequantizes into [-1, 1])."""
    spec = storage.spec
    for layer in range(spec.n_layers):
        keys, values = storage.key_cache[layer], storage.value_cache[layer]
        if spec.dtype != "int8":
            for cache in (keys, values):
                noise = rng.standard_normal(cache.shape, dtype=np.float32)
                cache[...] = noise.astype(np.float16).view(np.uint16) if spec.dtype == "float16" else noise
            continue
        keys[...] = rng.integers(-127, 128, keys.shape, dtype=np.int8)
        values[...] = rng.integers(-127, 128, values.shape, dtype=np.int8)
        # a tile's scales: (groups, block_size) fp16 after its head_dim × block_size values (`kvcache.storage`)
        for cache in (keys, values):
            tiles = cache.reshape(*cache.shape[:2], -1)
            tiles[..., spec.head_dim * spec.block_size :].view(np.float16)[...] = np.float16(1 / 127)


def kv_bytes_read(cfg: ModelConfig, spec: KVCacheSpec, context: int) -> int:
    """The K and V bytes a decode step at `context` attends over: every key on a layer that sees them
    all, the last `window` keys on a sliding-window layer (Gemma's local layers)."""
    per_layer_token = spec.bytes_per_token // spec.n_layers
    windows = [cfg.layer_window(layer) for layer in range(cfg.n_layers)]
    return sum(min(context, window) if window else context for window in windows) * per_layer_token


def _decode_batch(token: int, context: int, block_size: int) -> StepBatch:
    blocks = -(-context // block_size)
    position = context - 1
    kv = KVBatchArrays(block_tables=np.arange(blocks, dtype=np.int32)[None, :],
                       context_lens=np.array([context], np.int32), query_start_loc=np.array([0, 1], np.int32),
                       positions=np.array([position], np.int32),
                       slot_mapping=np.array([position], np.int32))  # fmt: skip
    return StepBatch(token_ids=np.array([token], np.int32), kv=kv, logit_rows=np.array([0], np.int32))


def measure(path: Path, contexts: list[int], kv_dtypes: list[str], threads: int, steps: int,
            block_size: int = 16) -> dict[str, Any]:
    model = load_model(path)
    cfg = model.config
    if max(contexts) > cfg.max_context:
        raise SystemExit(f"{path.name} was trained for {cfg.max_context} positions; contexts up to that only")
    cache = weight_cache.cache_file(model.path) if model.path.is_file() else None
    weights = KernelWeights.build(cfg, model.weights, fast=True, cache=cache)
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"model": str(path), "threads": threads, "contexts": contexts, "block_size": block_size,
                               "runs": {}}
    with SpinPool(threads) as pool:
        for dtype in kv_dtypes:
            spec = KVCacheSpec(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                               block_size=block_size, dtype=dtype)  # fmt: skip
            storage = KVCacheStorage.allocate(spec, -(-max(contexts) // block_size))
            _fill_random(storage, rng)
            runner = ModelRunner(model, storage, pool, max_num_tokens=1, max_logit_rows=1, weights=weights)
            batches = [_decode_batch(1, context, block_size) for context in contexts]
            for context, batch in zip(contexts, batches, strict=True):
                logits = runner.forward(batch)  # compile or load the kernels, touch the tiles
                if not np.isfinite(logits).all():
                    raise RuntimeError(f"{dtype} cache at context {context}: the step's logits are not finite")
            # the contexts take turns, step after step, so that a busy moment of a shared host slows them alike
            times: list[list[float]] = [[] for _ in contexts]
            for _ in range(steps):
                for context_times, batch in zip(times, batches, strict=True):
                    started = time.perf_counter()
                    runner.forward(batch)
                    context_times.append(time.perf_counter() - started)
            # each round's steps are paired: the median of their ratios is steadier than the ratio of medians
            results["runs"][dtype] = [{"context": context, "ms_per_token": 1e3 * statistics.median(context_times),
                                       "paired_ratio": statistics.median(t / s for t, s in zip(context_times, times[0],
                                                                                               strict=True)),
                                       "kv_mb_read": kv_bytes_read(cfg, spec, context) / 1e6}
                                      for context, context_times in zip(contexts, times, strict=True)]  # fmt: skip
            del runner, storage
    return results


def add_roof(results: dict[str, Any], read_gb_s: float) -> None:
    """Each longer context's KV read rate (the bytes it adds to the shortest context's step over the time
    it adds) and the ratio its step would have at `read_gb_s`, the memory's read bandwidth."""
    results["read_gb_s"] = read_gb_s
    for runs in results["runs"].values():
        shortest = runs[0]
        for run in runs[1:]:
            run["extra_kv_mb"] = extra_mb = run["kv_mb_read"] - shortest["kv_mb_read"]
            extra_ms = run["ms_per_token"] - shortest["ms_per_token"]
            run["extra_kv_gb_s"] = extra_mb / extra_ms if extra_ms > 0 else float("inf")  # MB per ms = GB/s
            run["roof_ratio"] = 1 + extra_mb / read_gb_s / shortest["ms_per_token"]


def report(results: dict[str, Any]) -> str:
    lines = [f"**{Path(results['model']).name}**, {results['threads']} threads: one decode step at each context "
             "(median ms per output token; its ratio to the shortest context's step taken in the same round, the "
             "median of those ratios; KV read per step)", "",
             "| context | " + " | ".join(results["runs"]) + " |",
             "| ---: | " + " | ".join("---:" for _ in results["runs"]) + " |"]  # fmt: skip
    for i, context in enumerate(results["contexts"]):
        cells = []
        for runs in results["runs"].values():
            run = runs[i]
            cells.append(f"{run['ms_per_token']:.1f} ms, {run['paired_ratio']:.2f}x, {run['kv_mb_read']:.0f} MB")
        lines.append(f"| {context:,} | " + " | ".join(cells) + " |")
    if "read_gb_s" in results:
        lines.append("")
        for dtype, runs in results["runs"].items():
            for run in runs[1:]:
                lines.append(f"- {dtype} at {run['context']:,}: the {run['extra_kv_mb']:.0f} MB "
                             f"of KV beyond {runs[0]['context']:,}'s read at {run['extra_kv_gb_s']:.1f} GB/s, "
                             f"{100 * run['extra_kv_gb_s'] / results['read_gb_s']:.0f}% of the "
                             f"{results['read_gb_s']:.1f} GB/s the pool's threads read; at that roof the step "
                             f"would take {run['roof_ratio']:.2f}x the shortest context's")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench long-decode", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--kv-dtypes", default="float16,int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the server's --block-size)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    results = measure(args.file, contexts, args.kv_dtypes.split(","), args.threads, args.steps, args.block_size)
    add_roof(results, measure_read_bandwidth(args.threads))
    print(report(results))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `treadle bench long-decode {args.file} "
          f"--contexts {args.contexts} --kv-dtypes {args.kv_dtypes} --threads {args.threads} "
          f"--block-size {args.block_size}`")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
