"""One "step" of barrier-separated ops, written once per synchronisation approach.

A step is `num_ops` ops; op k reads the vector op k-1 wrote (both threads' halves of it), so
threads must meet between ops. Every approach calls the same `apply_op` on the same row ranges,
so they differ only in how threads are started and how they meet.

    TINY_OP:      out[i] = 0.5 * in[63 - i] + 1            64 floats: pure synchronisation
    MATVEC_OP:    out = tanh(weights @ in)                  576 x 576 float32, split by rows

buffers: float32 (2, n), ping-pong: op k reads buffers[k % 2], writes buffers[1 - k % 2].
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, prange

from threadpool.atomics import cache_aligned_zeros
from threadpool.barrier import barrier_wait
from threadpool.pool import SpinPool

TINY_OP, MATVEC_OP = 0, 1
TINY_SIZE, MATVEC_SIZE = 64, 576
NUM_OPS = 300  # ops in one step of the benchmark
OP_KINDS = {"tiny": TINY_OP, "matvec": MATVEC_OP}


def make_operands(kind: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(weights float32 (n, n) or (1, 1) for tiny ops, buffers float32 (2, n)), 64-byte aligned so
    that timings do not depend on where the allocator happened to put them."""
    rng = np.random.default_rng(seed)
    size = TINY_SIZE if kind == TINY_OP else MATVEC_SIZE
    weights = cache_aligned_zeros((1, 1), np.float32)
    if kind == MATVEC_OP:
        weights = cache_aligned_zeros((size, size), np.float32)
        weights[:] = rng.standard_normal((size, size)) / np.sqrt(size)
    buffers = cache_aligned_zeros((2, size), np.float32)
    buffers[0] = rng.standard_normal(size)
    return weights, buffers


@njit(nogil=True, cache=True)
def row_range(num_rows: int, part: int, num_parts: int) -> tuple[int, int]:
    """Rows [first, last) of `part` when num_rows are split in num_parts contiguous blocks."""
    rows_per_part = (num_rows + num_parts - 1) // num_parts
    return min(num_rows, part * rows_per_part), min(num_rows, (part + 1) * rows_per_part)


@njit(nogil=True, cache=True, fastmath=True)
def apply_op(kind: int, weights: np.ndarray, inp: np.ndarray, out: np.ndarray, first: int, last: int) -> None:
    """Rows [first, last) of one op; see the module docstring."""
    size = inp.size
    if kind == TINY_OP:
        for i in range(first, last):  # reads the other thread's half: the barrier is needed
            out[i] = np.float32(0.5) * inp[size - 1 - i] + np.float32(1.0)
        return
    for row in range(first, last):
        total = np.float32(0.0)
        for col in range(size):
            total += weights[row, col] * inp[col]
        out[row] = np.tanh(total)


# ---- one thread ------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def step_serial(kind: int, weights: np.ndarray, buffers: np.ndarray, num_ops: int) -> None:
    for op in range(num_ops):
        apply_op(kind, weights, buffers[op % 2], buffers[1 - op % 2], 0, buffers.shape[1])


# ---- SpinPool: the whole step in one run, a spin barrier between ops -----------------------------


@njit(nogil=True, cache=True)
def step_kernel(tid: int, nthreads: int, barrier: np.ndarray, kind: int, weights: np.ndarray,
                buffers: np.ndarray, num_ops: int) -> None:
    first, last = row_range(buffers.shape[1], tid, nthreads)
    for op in range(num_ops):
        apply_op(kind, weights, buffers[op % 2], buffers[1 - op % 2], first, last)
        barrier_wait(barrier, tid)


def step_on_pool(pool: SpinPool, kind: int, weights: np.ndarray, buffers: np.ndarray, num_ops: int) -> None:
    pool.run(step_kernel, kind, weights, buffers, num_ops)


# ---- SpinPool, fork/join style: one run per op, dispatched from Python ----------------------------


@njit(nogil=True, cache=True)
def op_kernel(tid: int, nthreads: int, barrier: np.ndarray, kind: int, weights: np.ndarray,
              buffers: np.ndarray, op_index: np.ndarray) -> None:
    """Op number op_index[0]. The index travels in an array so that every run passes the same
    argument objects: the pool's workers then serve the runs without entering Python."""
    op = op_index[0]
    first, last = row_range(buffers.shape[1], tid, nthreads)
    apply_op(kind, weights, buffers[op % 2], buffers[1 - op % 2], first, last)


def step_on_pool_run_per_op(pool: SpinPool, kind: int, weights: np.ndarray, buffers: np.ndarray,
                            num_ops: int) -> None:
    op_index = np.zeros(1, dtype=np.int64)
    for op in range(num_ops):
        op_index[0] = op
        pool.run(op_kernel, kind, weights, buffers, op_index)


# ---- numba parallel=True: one prange region (fork/join) per op -----------------------------------


@njit(parallel=True, nogil=True, cache=True)
def step_prange(kind: int, weights: np.ndarray, buffers: np.ndarray, num_ops: int, num_parts: int) -> None:
    size = buffers.shape[1]
    for op in range(num_ops):
        inp, out = buffers[op % 2], buffers[1 - op % 2]
        for part in prange(num_parts):
            first, last = row_range(size, part, num_parts)
            apply_op(kind, weights, inp, out, first, last)


# ---- Python threading ------------------------------------------------------------------------------


def step_on_executor(executor: ThreadPoolExecutor, num_parts: int, kind: int, weights: np.ndarray,
                     buffers: np.ndarray, num_ops: int) -> None:
    """Submit one task per part for every op and wait for them all (fork/join)."""
    size = buffers.shape[1]
    for op in range(num_ops):
        inp, out = buffers[op % 2], buffers[1 - op % 2]
        futures = [
            executor.submit(apply_op, kind, weights, inp, out, *row_range(size, part, num_parts))
            for part in range(num_parts)
        ]
        for future in futures:
            future.result()


class PythonBarrierTeam:
    """Persistent Python threads meeting at a threading.Barrier after every op; the caller is
    part 0. A step starts with one extra barrier that hands the step to the helpers."""

    def __init__(self, num_parts: int) -> None:
        self.num_parts = num_parts
        self._barrier = threading.Barrier(num_parts)
        self._step: tuple[int, np.ndarray, np.ndarray, int] | None = None
        self._helpers = [
            threading.Thread(target=self._helper_main, args=(part,), daemon=True) for part in range(1, num_parts)
        ]
        for helper in self._helpers:
            helper.start()

    def step(self, kind: int, weights: np.ndarray, buffers: np.ndarray, num_ops: int) -> None:
        self._step = (kind, weights, buffers, num_ops)
        self._barrier.wait()
        self._share(0)

    def close(self) -> None:
        self._step = None
        self._barrier.wait()
        for helper in self._helpers:
            helper.join()

    def _helper_main(self, part: int) -> None:
        while True:
            self._barrier.wait()
            if self._step is None:
                return
            self._share(part)

    def _share(self, part: int) -> None:
        assert self._step is not None
        kind, weights, buffers, num_ops = self._step
        first, last = row_range(buffers.shape[1], part, self.num_parts)
        for op in range(num_ops):
            apply_op(kind, weights, buffers[op % 2], buffers[1 - op % 2], first, last)
            self._barrier.wait()
