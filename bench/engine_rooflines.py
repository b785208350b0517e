"""`treadle bench engine`'s rooflines, measured in the same run as the engine: the memory bandwidth a
decode step streams its weights at, float32 GEMM, and the int8 kernels' multiply-accumulate rate."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

from decoding.kernels.amx import TILE_TOKENS, tile_activations, tile_scratch
from decoding.kernels.fast_kernels import activation_arrays, matmul_groups, quantize_activation_rows
from decoding.kernels.kernels import split_range
from decoding.kernels.repack import is_packable, packed_type, repack
from decoding.kernels.vnni import GROUP_ROWS, MOST_GROUP_TOKENS
from decoding.model.model import Model
from threadpool import SpinPool, barrier_wait


def flops_per_token(model: Model) -> int:
    """Floating-point operations of one token through the weight matrices (2 per multiply-accumulate)."""
    flops = 2 * sum(m.n_rows * m.n_cols for layer in model.weights.layers
                    for m in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))
    return flops + 2 * model.weights.lm_head.n_rows * model.weights.lm_head.n_cols


@njit(nogil=True, cache=True, fastmath=True)
def _read_share(tid, nthreads, barrier, data, sums):  # type: ignore[no-untyped-def]
    """Sum this thread's contiguous share of `data`: a pure streaming read. Indexing the share's own
    slice from 0 (not `data[i]` over `range(begin, end)`, whose possibly-negative index keeps the
    wraparound check, nor `for value in share`, whose iterator is not vectorised either) and fastmath
    (the sum may be reassociated into vector lanes) let LLVM vectorise it: 36 GB/s on one core here,
    against 7-18 GB/s for those forms."""
    begin, end = split_range(data.shape[0], tid, nthreads)
    share = data[begin:end]
    total = np.float32(0.0)
    for i in range(share.shape[0]):
        total += share[i]
    sums[tid] = total
    barrier_wait(barrier, tid)


@njit(nogil=True, cache=True, fastmath=True)
def _triad_share(tid, nthreads, barrier, a, b, c, scalar):  # type: ignore[no-untyped-def]
    """STREAM's triad on this thread's share: a = b + scalar * c (two arrays read, one written)."""
    begin, end = split_range(a.shape[0], tid, nthreads)
    a_share, b_share, c_share = a[begin:end], b[begin:end], c[begin:end]
    for i in range(a_share.shape[0]):
        a_share[i] = b_share[i] + scalar * c_share[i]
    barrier_wait(barrier, tid)


GIB_FLOAT32 = 256 * 1024 * 1024  # float32 values in 1 GiB: far past every cache


def measure_read_bandwidth(threads: int) -> float:
    """GB/s reading 1 GiB of float32 on the pool's threads, each its own part: the memory roofline
    for a decode step, which streams every weight once split over the same threads. Best of 3."""
    data = np.ones(GIB_FLOAT32, dtype=np.float32)
    sums = np.zeros(threads, dtype=np.float32)
    best = 0.0
    with SpinPool(threads) as pool:
        pool.run(_read_share, data[: 1 << 16], sums)  # compile or load the kernel
        for _ in range(3):
            started = time.perf_counter()
            pool.run(_read_share, data, sums)
            best = max(best, data.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def measure_numpy_read_bandwidth(threads: int) -> float:
    """The check on `measure_read_bandwidth`: numpy's `sum` over 1 GiB split into one part per Python
    thread (numpy releases the GIL inside the reduction). Best of 3."""
    data = np.ones(GIB_FLOAT32, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(3):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, data.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def measure_triad_bandwidth(threads: int) -> float:
    """GB/s of STREAM's triad (a = b + s·c, three 1/3-GiB arrays, counted as 3 × 4 bytes per element as
    STREAM counts them) on the pool's threads. Best of 3."""
    n = GIB_FLOAT32 // 3
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    best = 0.0
    with SpinPool(threads) as pool:
        pool.run(_triad_share, a[:4096], b[:4096], c[:4096], np.float32(3.0))
        for _ in range(3):
            started = time.perf_counter()
            pool.run(_triad_share, a, b, c, np.float32(3.0))
            best = max(best, 3 * a.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def vnni_issue_gmacs(threads: int) -> float | None:
    """The int8 probe's check: one 512-bit VNNI dot product (64 multiply-accumulates) issued per cycle
    per thread at the clock /proc/cpuinfo reports, in GMAC/s (cores with two such ports reach twice
    that). None where the clock is not reported."""
    try:
        clocks = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("cpu MHz")]
    except OSError:
        return None
    return threads * max(clocks) / 1e3 * 64 if clocks else None


def measure_gemm_gflops() -> float:
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    a @ a
    started = time.perf_counter()
    for _ in range(4):
        a @ a
    return 4 * 2 * 1024**3 / (time.perf_counter() - started) / 1e9


@njit(nogil=True, cache=True)
def int8_matmul_repeats(tid, nthreads, barrier, packed, qtype, n_rows, n_cols, xq, xd, xsum, n_tokens, out, tmp,
                         tiles, tile_out, repeats):  # fmt: skip
    g0, g1 = split_range(n_rows // 8, tid, nthreads)
    for _ in range(repeats):
        matmul_groups(packed, qtype, n_cols, xq, xd, xsum, n_tokens, out, g0, g1, False, tmp[tid], tiles,
                      tile_out[tid])
        barrier_wait(barrier, tid)


def measure_int8_gmacs(model: Model, threads: int, tokens: int | None = None, tile_mode: int = 0) -> float | None:
    """Multiply-accumulates per second of the fast kernels on the pool, weights in cache: the compute
    ceiling of a batched step (a 32-sequence decode step is int8 dot products, not memory traffic).

    One feed-forward matrix of the model (repacked: a few hundred KB for a small model, in L2; 8-40 MB at
    1.5B-7B, streamed from L3 or memory at ~0.02 byte per multiply-accumulate for 32 tokens, well under
    the memory's speed), `tokens` activation rows (in L1), split over the threads as a step splits it;
    through AMX tiles with `tile_mode` (decoding.kernels.amx). `tokens` defaults to 32 on the VNNI kernels and
    to a prompt's 256 through the tiles (a step takes them only from amx.FEWEST_TILED_TOKENS on, and each pass
    unpacks the weights once for all its tiles). None when the matrix is not packable.
    """
    tokens = tokens or (256 if tile_mode else 32)
    matrix = model.weights.layers[0].w_up
    if not is_packable(matrix.qtype, matrix.n_rows):
        return None
    rows, cols = matrix.n_rows, matrix.n_cols
    packed = repack(matrix.data, matrix.qtype, rows, cols)
    x = np.random.default_rng(0).standard_normal((tokens, cols)).astype(np.float32)
    xq, xd, xsum = activation_arrays(tokens, cols)
    tiles = tile_activations(tile_mode, tokens, cols, TILE_TOKENS)
    quantize_activation_rows(x, cols, 0, tokens, xq, xd, xsum, tiles, tokens)
    out = np.zeros((tokens, rows), np.float32)
    tmp = np.zeros((threads, MOST_GROUP_TOKENS, GROUP_ROWS), np.float32)
    tile_out = np.ascontiguousarray(tile_scratch(threads, tile_mode, cols, tokens)[:, 0])
    repeats = max(5, 50 * 32 // tokens)
    best = float("inf")
    with SpinPool(threads) as pool:
        args = (packed, int(packed_type(matrix.qtype)), rows, cols, xq, xd, xsum, tokens, out, tmp, tiles, tile_out)
        pool.run(int8_matmul_repeats, *args, 1)  # compile or load, warm the caches
        for _ in range(5):
            started = time.perf_counter()
            pool.run(int8_matmul_repeats, *args, repeats)
            best = min(best, time.perf_counter() - started)
    return repeats * rows * cols * tokens / best / 1e9
