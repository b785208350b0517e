"""A software prefetch for nopython kernels: `llvm.prefetch`, which numba does not expose.

Paged attention walks a sequence's blocks in block-table order, and the blocks of a cache shared by
many sequences lie anywhere in it: each (KV head, block) tile starts at an address the hardware
prefetcher cannot guess, so without help every tile begins with a full DRAM miss. Asking for the
next tile while the current one is being computed hides that latency.
"""

from __future__ import annotations

from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE_BYTES = 64

# numba's LLVM is set up without an assembly parser; `emit_pinned_prefetch`'s inline assembly needs one
binding.initialize_native_asmparser()


def emit_pinned_prefetch(builder: ir.IRBuilder, address: ir.Value) -> None:
    """`prefetcht1` of the line at `address` (i8*), emitted where it is written in the IR.

    LLVM's scheduler moves `llvm.prefetch` freely, having nothing to order it by: in the int8
    attention kernel it gathered the requests for later K tiles (34 a block) into one burst at the
    top of the call, and attention from DRAM waited behind it (two blocks a call, 68 requests in a
    burst: 32k keys took 350-560 ns a block a thread where one block a call took 280-440). As
    inline assembly with side effects it keeps its place among the kernel's loads, so the requests
    go out at the pace of the arithmetic (x86-64 only, as the thread pool's `pause` is)."""
    builder.asm(ir.FunctionType(ir.VoidType(), [address.type]), "prefetcht1 ($0)", "r", [address], side_effect=True)


@intrinsic
def prefetch_element(typingctx, array, index):  # type: ignore[no-untyped-def]
    """Hint the cache line holding element `index` of a C-contiguous array (flat index) into L2."""
    if not (isinstance(array, types.Array) and array.layout == "C" and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        address = builder.bitcast(builder.gep(data, [offset]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), "llvm.prefetch.p0"
        )
        # read (0), locality 2 (`prefetcht1`: into L2, not L1), data cache (1). Into L1, a block's
        # 68-256 lines overran the L1's few miss buffers and a long context's attention ran 35-50%
        # slower on a Zen 4 guest than with its tiles brought to L2, where the kernel's loads find
        # them (a Zen 5 guest had measured L1 faster: docs/performance.md, long contexts).
        builder.call(prefetch, [address, i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@njit(nogil=True, cache=True, inline="always")
def prefetch_tile(tile):  # type: ignore[no-untyped-def]
    """Prefetch every cache line of a C-contiguous array (a KV tile of a few KiB)."""
    step = max(1, CACHE_LINE_BYTES // tile.itemsize)
    for index in range(0, tile.size, step):
        prefetch_element(tile, index)
