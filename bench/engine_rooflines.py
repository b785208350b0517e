"""`treadle bench engine`'s rooflines, measured in the same run as the engine: the memory bandwidth a
decode step streams its weights at, float32 GEMM, and the int8 kernels' multiply-accumulate rate."""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from decoding.kernels.fast_kernels import matmul_groups, quantize_activation_row
from decoding.kernels.kernels import split_range
from decoding.kernels.repack import is_packable, packed_type, repack
from decoding.model.model import Model
from threadpool import SpinPool, barrier_wait


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
def int8_matmul_repeats(tid, nthreads, barrier, packed, qtype, n_rows, n_cols, xq, xd, xsum, n_tokens, out, tmp,
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
        args = (packed, int(packed_type(matrix.qtype)), rows, cols, xq, xd, xsum, tokens, out, tmp)
        pool.run(int8_matmul_repeats, *args, 1)  # compile or load, warm the caches
        for _ in range(5):
            started = time.perf_counter()
            pool.run(int8_matmul_repeats, *args, repeats)
            best = min(best, time.perf_counter() - started)
    return repeats * rows * cols * tokens / best / 1e9
