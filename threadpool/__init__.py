"""A pool of persistent, pinned threads that run numba kernels SPMD and meet at spin barriers.

    from threadpool import SpinPool, barrier_wait

    @numba.njit(nogil=True, cache=True)
    def scale(tid, nthreads, barrier, x, y):      # x, y: float32 (n,)
        rows = (x.size + nthreads - 1) // nthreads
        for i in range(tid * rows, min(x.size, (tid + 1) * rows)):
            y[i] = 2 * x[i]
        barrier_wait(barrier, tid)                 # every thread now sees all of y

    with SpinPool() as pool:
        pool.run(scale, x, y)

Atomics for nopython code live in `threadpool.atomics`; the benchmark in `bench.pool`.
"""

from threadpool.numba_cache import use_numba_cache

use_numba_cache()  # before any kernel of the package is compiled: threadpool/numba_cache.py says why

from threadpool.barrier import BarrierAborted, barrier_wait, make_barrier  # noqa: E402
from threadpool.pool import BrokenPool, SpinPool  # noqa: E402

__all__ = ["BarrierAborted", "BrokenPool", "SpinPool", "barrier_wait", "make_barrier"]
