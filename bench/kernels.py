"""`treadle bench kernels`: the matmul kernels per storage type — int8 (fast) and float32 (exact).

    .venv/bin/treadle bench kernels [--json PATH] [--threads N] [--rows R] [--cols C]

One synthetic matrix per type (R × C, random weights; K types as random super-blocks), multiplied by
1 and by 32 activation rows on the pool's threads, as a model step splits it:

- weights in cache (the matrix is small enough for L2): multiply-accumulates per second, the compute
  ceiling of a batched step;
- weights from DRAM (a matrix 128 times larger, read once per repeat): the bytes of weights, as held
  in memory (repacked), per second a single-stream decode reads;
- where AMX is granted (decoding.kernels.amx_probe), the 32 rows again through the AMX tiles.

Types the int8 kernels do not run yet are timed on the float32 path, which every mode falls back to.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import gguf
import numpy as np
from numba import njit

from bench.engine_rooflines import int8_matmul_repeats
from bench.pool import machine_description
from decoding.kernels.amx import HARDWARE, TILE_TOKENS, tile_activations, tile_scratch
from decoding.kernels.amx_probe import tile_support
from decoding.kernels.fast_kernels import activation_arrays, quantize_activation_rows
from decoding.kernels.kernels import matmul_rows, split_range
from decoding.kernels.repack import is_packable, packed_type, repack
from decoding.kernels.vnni import GROUP_ROWS, MOST_GROUP_TOKENS
from decoding.model.quant import BLOCK_SHAPES, FP16_FIELDS, K_TYPES, QType, dequantize, quantize
from threadpool import SpinPool, barrier_wait
from threadpool.affinity import usable_cores

TYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K,
         QType.F16)


@njit(nogil=True, cache=True)
def _repeat_float(tid, nthreads, barrier, weight, qtype, n_rows, n_cols, x, n_tokens, out, buf, repeats):
    r0, r1 = split_range(n_rows, tid, nthreads)
    for _ in range(repeats):
        matmul_rows(weight, qtype, n_cols, x, n_tokens, out, 0, r0, r1, False, buf[tid])
        barrier_wait(barrier, tid)


def random_k_blocks_like(weights: np.ndarray, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 of random `qtype` super-blocks (every quantized bit random) whose fp16
    scales make the dequantized weights spread like `weights`: neither treadle nor the gguf package
    quantizes to the K types."""
    rows, cols = weights.shape
    per_block, size = BLOCK_SHAPES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[..., offset : offset + 2] = np.ones(blocks.shape[:2], np.float16)[..., None].view(np.uint8)
    factor = weights.std() / dequantize(blocks.reshape(rows, -1), qtype, cols).std()
    for offset in FP16_FIELDS[qtype]:
        scale = (factor * (0.5 + rng.random(blocks.shape[:2]))).astype(np.float16)
        blocks[..., offset : offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def store_as(weights: np.ndarray, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """float32 (rows, cols) weights in storage type `qtype`, as a GGUF tensor holds them: quantized by
    treadle, or by the gguf package for Q5_0/Q5_1; for the K types, which neither quantizes, random
    super-blocks of the same spread (the benchmarks' and tests' kernels care for the layout, not values)."""
    if qtype in (QType.Q5_0, QType.Q5_1):
        return np.asarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType(int(qtype))))
    if qtype in K_TYPES:
        return random_k_blocks_like(weights, qtype, rng)
    return quantize(weights, qtype)


def stored_matrix(qtype: QType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 of `qtype` holding random weights."""
    weights = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
    return store_as(weights, qtype, rng).view(np.uint8).reshape(rows, -1)


def time_matmul(qtype: QType, rows: int, cols: int, tokens: int, threads: int, repeats: int,
                tile_mode: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(int(qtype))
    stored = stored_matrix(qtype, rows, cols, rng)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    out = np.zeros((tokens, rows), np.float32)
    int8 = is_packable(qtype, rows)
    with SpinPool(threads) as pool:
        if int8:
            xq, xd, xsum = activation_arrays(tokens, cols)
            tiles = tile_activations(tile_mode, tokens, cols, TILE_TOKENS)
            quantize_activation_rows(x, cols, 0, tokens, xq, xd, xsum, tiles, tokens)
            packed = repack(stored, qtype, rows, cols)
            resident = packed.nbytes
            args: tuple[Any, ...] = (packed, int(packed_type(qtype)), rows, cols, xq, xd, xsum, tokens, out,
                                     np.zeros((threads, MOST_GROUP_TOKENS, GROUP_ROWS), np.float32), tiles,
                                     np.ascontiguousarray(tile_scratch(threads, tile_mode, cols, tokens)[:, 0]))
            kernel = int8_matmul_repeats
        else:
            resident = stored.nbytes
            args = (stored, int(qtype), rows, cols, x, tokens, out, np.zeros((threads, cols), np.float32))
            kernel = _repeat_float
        pool.run(kernel, *args, 1)  # compile or load, warm up
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            pool.run(kernel, *args, repeats)
            best = min(best, time.perf_counter() - started)
    seconds = best / repeats
    return {"type": qtype.name, "path": "int8" if int8 else "float32", "rows": rows, "cols": cols,
            "tokens": tokens, "us": seconds * 1e6, "gmacs": rows * cols * tokens / seconds / 1e9,
            "weight_gbs": resident / seconds / 1e9, "bits_per_weight": stored.nbytes * 8 / (rows * cols),
            "resident_bits_per_weight": resident * 8 / (rows * cols)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--threads", type=int, default=None, help="pool threads (default: every usable core)")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    args = parser.parse_args(argv)
    threads = args.threads or len(usable_cores())
    results = []
    tiles_granted = tile_support().granted
    # a type stores whole blocks (32 weights; 256 for the K types; float types any width): a width a
    # type's block does not divide is skipped
    types = [qtype for qtype in TYPES if args.cols % BLOCK_SHAPES.get(qtype, (1,))[0] == 0]
    skipped = [qtype.name for qtype in TYPES if qtype not in types]
    for qtype in types:
        in_cache = [time_matmul(qtype, args.rows, args.cols, tokens, threads, 50) for tokens in (1, 32)]
        from_dram = time_matmul(qtype, 128 * args.rows, args.cols, 1, threads, 5)
        tiles = (time_matmul(qtype, args.rows, args.cols, 32, threads, 50, HARDWARE)
                 if tiles_granted and is_packable(qtype, args.rows) else None)  # fmt: skip
        results.append({"in_cache": in_cache, "from_dram": from_dram, "amx_tiles": tiles})
    print(f"Matmul kernels per storage type, {threads} threads, {args.rows} x {args.cols} in cache, "
          f"{128 * args.rows} x {args.cols} from DRAM")
    print(f"{'type':<6} {'path':<8} {'bits/w stored':>13} {'in memory':>9} {'GMAC/s x1':>10} {'GMAC/s x32':>11} "
          f"{'DRAM GB/s x1':>13}" + (f" {'AMX x32':>8}" if tiles_granted else ""))
    for r in results:
        one, many = r["in_cache"]
        print(f"{one['type']:<6} {one['path']:<8} {one['bits_per_weight']:>13.2f} "
              f"{one['resident_bits_per_weight']:>9.2f} "
              f"{one['gmacs']:>10.1f} {many['gmacs']:>11.1f} {r['from_dram']['weight_gbs']:>13.1f}"
              + (f" {r['amx_tiles']['gmacs'] if r['amx_tiles'] else float('nan'):>8.1f}" if tiles_granted else ""))
    if skipped:
        print(f"skipped (rows of {args.cols} weights are not whole blocks of theirs): {', '.join(skipped)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(), "threads": threads, "results": results}, f, indent=2)
    return 0
