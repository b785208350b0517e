"""`treadle bench batch-decode FILE.gguf`: one decode step of N sequences together, beside the int8 roof.

    .venv/bin/treadle bench batch-decode /tmp/shapes/qwen2.5-1.5b-q4_k_m.gguf [--streams 1,8,32]
        [--context 128] [--prompt-tokens 512] [--threads 2] [--steps 10] [--json PATH]

At 1.5B-8B a batched decode step is int8 dot products, not memory traffic: this measures the model's
real step (`ModelRunner.forward`, the fast kernels on the spin pool, the weight cache mapped) with N
sequences each decoding one token at position `context` - 1 over a float16 KV cache (random values:
a step's time does not depend on them), and reports per level the median step time, the
multiply-accumulates it does per second (every matrix and the LM head, per token) and their share of
the int8 probe measured in the same run, before and after the steps, the higher of the two
(`bench.engine_rooflines.measure_int8_gmacs`; the AMX tiles' for steps that take them, where they are
granted), and where the step's time goes (the kernels' phases). With
--prompt-tokens, one more row: one sequence's prompt of that many tokens as a single step (causal
attention over itself, no LM head but its last row's), whose multiply-accumulates are every layer's
matrices per token. With --against-no-tiles ROUNDS, where AMX tiles run, each step is also alternated
with the same step on the VNNI kernels alone (`fast-no-amx`) in the same process, and the table adds the
median time without tiles and the median ratio. With --against-one-row ROUNDS, the prompt's step is also
alternated with attention items of one query row each (`kvcache.attention.attention_scratch(rows_together=1)`)
instead of `ROWS_TOGETHER` rows walking their blocks together, after checking that both give the same
logits: each's median paged-attention time (its phase's share of the step) and their median ratio.
Through HTTP (`bench sizes`) the same streams also carry their prompts, scheduling and streaming; this is
the step alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from decoding import load_model
from decoding.engine.runner import ModelRunner, StepBatch
from decoding.kernels import weight_cache
from decoding.kernels.forward import KernelWeights
from decoding.kernels.phases import PHASES
from decoding.model.config import ModelConfig
from kvcache.attention import ROWS_TOGETHER, attention_scratch
from kvcache.batch import KVBatchArrays
from kvcache.storage import KVCacheSpec, KVCacheStorage
from threadpool import SpinPool

BLOCK_SIZE = 16


def prompt_macs_per_token(cfg: ModelConfig) -> int:
    """Multiply-accumulates of one prompt token's matrices: each layer's projections and feed-forward (the
    experts a token uses, and the router); the LM head runs for the last token only."""
    attention = (cfg.q_dim + 2 * cfg.kv_dim) * cfg.dim + cfg.dim * cfg.q_dim
    return cfg.n_layers * (attention + max(cfg.n_experts_used, 1) * 3 * cfg.dim * cfg.hidden_dim
                           + cfg.n_experts * cfg.dim)


def decode_macs_per_token(cfg: ModelConfig) -> int:
    """Multiply-accumulates of one decoded token's matrices: each layer's projections and feed-forward (the
    experts a token uses, and the router), and the LM head."""
    return prompt_macs_per_token(cfg) + cfg.vocab_size * cfg.dim


def _decode_batch(streams: int, context: int) -> StepBatch:
    blocks = -(-context // BLOCK_SIZE)
    tables = np.arange(streams * blocks, dtype=np.int32).reshape(streams, blocks)
    position = context - 1
    kv = KVBatchArrays(block_tables=tables, context_lens=np.full(streams, context, np.int32),
                       query_start_loc=np.arange(streams + 1, dtype=np.int32),
                       positions=np.full(streams, position, np.int32),
                       slot_mapping=(tables[:, position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE))
    return StepBatch(token_ids=np.ones(streams, np.int32), kv=kv, logit_rows=np.arange(streams, dtype=np.int32))


def _prompt_batch(tokens: int) -> StepBatch:
    blocks = -(-tokens // BLOCK_SIZE)
    table = np.arange(blocks, dtype=np.int32)
    positions = np.arange(tokens, dtype=np.int32)
    kv = KVBatchArrays(block_tables=table.reshape(1, blocks), context_lens=np.array([tokens], np.int32),
                       query_start_loc=np.array([0, tokens], np.int32), positions=positions,
                       slot_mapping=table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
    token_ids = np.random.default_rng(1).integers(0, 1000, tokens).astype(np.int32)
    return StepBatch(token_ids=token_ids, kv=kv, logit_rows=np.array([tokens - 1], np.int32))


def _time_step(runner: ModelRunner, batch: StepBatch, steps: int) -> tuple[float, dict[str, float]]:
    """The median of `steps` steps after a first one (compiles or loads the kernels, warms the caches), and
    each phase's share of their time."""
    logits = runner.forward(batch)
    if not np.isfinite(logits).all():
        raise RuntimeError("the step's logits are not finite")
    runner.profile_phases(True)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - started)
    cycles = runner.phase_cycles
    runner.profile_phases(False)
    return statistics.median(times), {name: float(c / cycles.sum()) for name, c in zip(PHASES, cycles, strict=True)
                                      if c}


def _against_no_tiles(runners: dict[str, ModelRunner], batch: StepBatch, rounds: int) -> dict[str, float]:
    """The same step with the tiles (`fast`) and without (`fast-no-amx`), alternated `rounds` times in this
    process (a guest's speed drifts by tens of percent between runs a minute apart): the median time without,
    and the median of each round's ratio."""
    first = {kernels: runner.forward(batch).copy() for kernels, runner in runners.items()}
    if not np.array_equal(first["fast"], first["fast-no-amx"]):
        raise RuntimeError("the tiles' step gave other logits than the VNNI kernels'")
    times: dict[str, list[float]] = {kernels: [] for kernels in runners}
    for _ in range(rounds):
        for kernels, runner in runners.items():
            started = time.perf_counter()
            runner.forward(batch)
            times[kernels].append(time.perf_counter() - started)
    ratios = [without / with_ for with_, without in zip(times["fast"], times["fast-no-amx"], strict=True)]
    return {"no_tiles_step_ms": 1e3 * statistics.median(times["fast-no-amx"]),
            "tiles_speedup": statistics.median(ratios)}  # fmt: skip


def _against_one_row(runner: ModelRunner, cfg: ModelConfig, batch: StepBatch, rounds: int) -> dict[str, float]:
    """The prompt's step with its attention items of `ROWS_TOGETHER` rows (the step's own scratch) and of one
    row, alternated `rounds` times in this process: each's median paged-attention time (the phase's share of
    the step's cycles times the step) and the median of each round's ratio, once both gave the same logits."""
    together = runner.state.attn_scratch
    scratches = {"rows": together, "one_row": attention_scratch(together.shape[0], cfg.n_heads, cfg.n_kv_heads,
                                                                cfg.head_dim, BLOCK_SIZE, rows_together=1)}
    logits: dict[str, np.ndarray] = {}
    attention: dict[str, list[float]] = {name: [] for name in scratches}
    try:
        for _ in range(rounds):
            for name, scratch in scratches.items():
                runner.state = runner.state._replace(attn_scratch=scratch)
                runner.profile_phases(True)
                started = time.perf_counter()
                logits.setdefault(name, runner.forward(batch).copy())
                took = time.perf_counter() - started
                cycles = runner.phase_cycles
                attention[name].append(took * float(cycles[PHASES.index("paged attention")] / cycles.sum()))
                runner.profile_phases(False)
    finally:
        runner.state = runner.state._replace(attn_scratch=together)
    if not np.array_equal(logits["rows"], logits["one_row"]):
        raise RuntimeError("attention items of one row gave other logits than items of several")
    ratios = [alone / shared for shared, alone in zip(attention["rows"], attention["one_row"], strict=True)]
    return {"attention_ms": 1e3 * statistics.median(attention["rows"]),
            "one_row_attention_ms": 1e3 * statistics.median(attention["one_row"]),
            "rows_together_speedup": statistics.median(ratios)}  # fmt: skip


def measure(path: Path, streams: list[int], context: int, threads: int, steps: int,
            prompt_tokens: int = 0, against_no_tiles: int = 0, against_one_row: int = 0) -> dict[str, Any]:  # fmt: skip
    """Each level's step (and the prompt's); with `against_no_tiles` rounds, where the tiles run (granted, or
    TREADLE_AMX=emulate), each step also alternated with the same step without them; with `against_one_row`
    rounds, the prompt's step also alternated with attention items of one row."""
    from bench.engine_rooflines import measure_int8_gmacs
    from decoding.kernels.amx import HARDWARE
    from decoding.kernels.amx_probe import tile_support

    model = load_model(path)
    cfg = model.config
    cache = weight_cache.cache_file(model.path) if model.path.is_file() else None
    weights = KernelWeights.build(cfg, model.weights, fast=True, cache=cache)
    spec = KVCacheSpec(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       block_size=BLOCK_SIZE, dtype="float16")  # fmt: skip
    n_blocks = max(max(streams) * -(-context // BLOCK_SIZE), -(-prompt_tokens // BLOCK_SIZE))
    storage = KVCacheStorage.allocate(spec, n_blocks)
    rng = np.random.default_rng(0)
    for layer in range(cfg.n_layers):
        for cache_array in (storage.key_cache[layer], storage.value_cache[layer]):
            cache_array[...] = rng.standard_normal(cache_array.shape, dtype=np.float32).astype(np.float16).view(
                np.uint16)
    macs = decode_macs_per_token(cfg)
    results: dict[str, Any] = {"model": str(path), "threads": threads, "context": context,
                               "decode_macs_per_token": macs, "levels": []}  # fmt: skip
    def probes() -> dict[str, float | None]:
        return {"int8_gmacs": measure_int8_gmacs(model, threads),
                "amx_int8_gmacs": measure_int8_gmacs(model, threads, tile_mode=HARDWARE)
                if tile_support().granted else None}  # fmt: skip

    before = probes()
    rows = max(max(streams), prompt_tokens)
    with SpinPool(threads) as pool:
        runner = ModelRunner(model, storage, pool, max_num_tokens=rows, max_logit_rows=rows, weights=weights)
        runners = {"fast": runner, "fast-no-amx": ModelRunner(model, storage, pool, max_num_tokens=rows,
                                                              max_logit_rows=rows, kernels="fast-no-amx",
                                                              weights=weights)} \
            if against_no_tiles and runner.state.tiles.mode else None  # fmt: skip
        for n in streams:
            step, phases = _time_step(runner, _decode_batch(n, context), steps)
            results["levels"].append({"streams": n, "step_ms": 1e3 * step, "tokens_per_s": n / step,
                                      "gmacs": n * macs / step / 1e9, "phases": phases})  # fmt: skip
            if runners:
                results["levels"][-1].update(_against_no_tiles(runners, _decode_batch(n, context), against_no_tiles))
        if prompt_tokens:
            step, phases = _time_step(runner, _prompt_batch(prompt_tokens), steps)
            # the LM head runs once, for the prompt's last row
            prompt_macs = prompt_tokens * prompt_macs_per_token(cfg) + cfg.vocab_size * cfg.dim
            results["prompt"] = {"tokens": prompt_tokens, "step_ms": 1e3 * step, "tokens_per_s": prompt_tokens / step,
                                 "gmacs": prompt_macs / step / 1e9, "phases": phases}  # fmt: skip
            if runners:
                results["prompt"].update(_against_no_tiles(runners, _prompt_batch(prompt_tokens), against_no_tiles))
            if against_one_row:
                results["prompt"].update(_against_one_row(runner, cfg, _prompt_batch(prompt_tokens), against_one_row))
    after = probes()
    # the guests here change speed by tens of percent within minutes: the roof is the higher of two probes
    results["probes"] = {"before": before, "after": after}
    for name in ("int8_gmacs", "amx_int8_gmacs"):
        measured = [probe[name] for probe in (before, after) if probe[name]]
        results[name] = max(measured) if measured else None
    return results


def report(results: dict[str, Any]) -> str:
    from decoding.kernels.amx import FEWEST_TILED_TOKENS

    int8, tiles = results["int8_gmacs"], results["amx_int8_gmacs"]
    levels = results["levels"] + ([results["prompt"]] if results.get("prompt") else [])
    compared = (" without tiles, ms | the tiles' speedup |", " ---: | ---: |") \
        if any("tiles_speedup" in level for level in levels) else ("", "")  # fmt: skip
    probes = f"the int8 probe {int8 or 0:.0f} GMAC/s" + (
        f", the AMX tiles' {tiles:.0f} (the roof of steps of {FEWEST_TILED_TOKENS} tokens or more, which take them)"
        if tiles else "")  # fmt: skip
    lines = [f"**{Path(results['model']).name}**, {results['threads']} threads, context {results['context']}: one "
             f"decode step of N sequences ({results['decode_macs_per_token'] / 1e9:.2f} GMAC a token; {probes}, "
             f"the higher of a probe before and after the steps)", "",
             "| streams | step, ms | tokens/s | GMAC/s | share of the roof | largest phases |" + compared[0],
             "| ---: | ---: | ---: | ---: | ---: | --- |" + compared[1]]  # fmt: skip
    rows = [(str(level["streams"]), level["streams"], level) for level in results["levels"]]
    if results.get("prompt"):
        rows.append((f"a {results['prompt']['tokens']}-token prompt", results["prompt"]["tokens"], results["prompt"]))
    for label, tokens, level in rows:
        roof = tiles if tiles and tokens >= FEWEST_TILED_TOKENS else int8
        phases = sorted(level["phases"].items(), key=lambda item: -item[1])[:3]
        share = f"{level['gmacs'] / roof:.0%}" if roof else "—"
        line = (f"| {label} | {level['step_ms']:.1f} | {level['tokens_per_s']:.1f} | {level['gmacs']:.0f} | {share} | "
                + ", ".join(f"{n} {s:.0%}" for n, s in phases) + " |")  # fmt: skip
        if compared[0]:
            line += (f" {level['no_tiles_step_ms']:.1f} | {level['tiles_speedup']:.2f}x |" if "tiles_speedup" in level
                     else " — | — |")  # fmt: skip
        lines.append(line)
    prompt = results.get("prompt") or {}
    if "rows_together_speedup" in prompt:
        lines += ["", f"The prompt's paged attention, items of {ROWS_TOGETHER} rows against items of one: "
                      f"{prompt['attention_ms']:.1f} against {prompt['one_row_attention_ms']:.1f} ms, "
                      f"{prompt['rows_together_speedup']:.2f}x (medians of alternated rounds; the same logits)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench batch-decode", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--context", type=int, default=128, help="each sequence's position (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="also one prompt of this many tokens as a single step (default: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--against-no-tiles", type=int, default=0, metavar="ROUNDS",
                        help="where AMX tiles run, also each step without them, alternated ROUNDS times in this "
                             "process: the tiles' speedup (default: not)")
    parser.add_argument("--against-one-row", type=int, default=0, metavar="ROUNDS",
                        help="also the prompt's step with attention items of one query row, alternated ROUNDS "
                             "times in this process: what rows walking their blocks together give (default: not)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = measure(args.file, [int(s) for s in args.streams.split(",")], args.context, args.threads, args.steps,
                      args.prompt_tokens, args.against_no_tiles, args.against_one_row)
    print(report(results))
    prompt = f" --prompt-tokens {args.prompt_tokens}" if args.prompt_tokens else ""
    prompt += f" --against-no-tiles {args.against_no_tiles}" if args.against_no_tiles else ""
    prompt += f" --against-one-row {args.against_one_row}" if args.against_one_row else ""
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `treadle bench batch-decode {args.file} "
          f"--streams {args.streams} --context {args.context}{prompt} --threads {args.threads}`")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
