"""A software prefetch for nopython kernels: `llvm.prefetch`, which numba does not expose.

Paged attention walks a sequence's blocks in block-table order, and the blocks of a cache shared by
many sequences lie anywhere in it: each (block, KV head) tile starts at an address the hardware
prefetcher cannot guess, so without help every tile begins with a full DRAM miss. Asking for the
next tile while the current one is being computed hides that latency.

Tiles are named by (cache, block, KV head), never by a view of the cache: each numba view takes and
drops a reference on the cache's memory, an atomic operation on a line that every thread of the
step shares, and a long context's attention would pay it for every block.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE_BYTES = 64
_i8, _i32, _i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


def is_tiled_cache(array: types.Type) -> bool:
    """A KV cache layer as the kernels read it: (blocks, KV heads, rows, columns), C-contiguous."""
    return isinstance(array, types.Array) and array.ndim == 4 and array.layout == "C"


def tile_pointer(context, builder, array_type, array_value, block_id, kv_head) -> ir.Value:  # type: ignore[no-untyped-def]
    """The first byte (as i8*) of tile (block_id, kv_head), int64 IR values, of a C-contiguous 4-D cache."""
    array = context.make_array(array_type)(context, builder, array_value)
    strides = cgutils.unpack_tuple(builder, array.strides)
    offset = builder.add(builder.mul(block_id, strides[0]), builder.mul(kv_head, strides[1]))
    return builder.gep(builder.bitcast(array.data, _i8.as_pointer()), [offset])


@intrinsic
def prefetch_tile(typingctx, cache, block_id, kv_head):  # type: ignore[no-untyped-def]
    """Hint every cache line of tile (block_id, kv_head) of a C-contiguous 4-D KV cache into L2."""
    if not (is_tiled_cache(cache) and isinstance(block_id, types.Integer) and isinstance(kv_head, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        cache_type, block_type, head_type = signature.args
        block = context.cast(builder, args[1], block_type, types.int64)
        head = context.cast(builder, args[2], head_type, types.int64)
        base = tile_pointer(context, builder, cache_type, args[0], block, head)
        tile_bytes = cgutils.unpack_tuple(builder, context.make_array(cache_type)(context, builder, args[0]).strides)[1]
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [base.type, _i32, _i32, _i32]), "llvm.prefetch.p0"
        )
        entry = builder.block
        loop, done = builder.append_basic_block("prefetch_lines"), builder.append_basic_block("prefetch_done")
        builder.cbranch(builder.icmp_signed(">", tile_bytes, ir.Constant(_i64, 0)), loop, done)
        builder.position_at_end(loop)
        offset = builder.phi(_i64)
        offset.add_incoming(ir.Constant(_i64, 0), entry)
        # read (0), locality 2 (`prefetcht1`: into L2, not L1), data cache (1). Into L1, a block's
        # 68-256 lines overran the L1's few miss buffers and a long context's attention ran 35-50%
        # slower on a Zen 4 guest than with its tiles brought to L2, where the kernel's loads find
        # them (a Zen 5 guest had measured L1 faster: docs/performance.md, long contexts).
        builder.call(prefetch, [builder.gep(base, [offset]), _i32(0), _i32(2), _i32(1)])
        next_offset = builder.add(offset, ir.Constant(_i64, CACHE_LINE_BYTES))
        offset.add_incoming(next_offset, loop)
        builder.cbranch(builder.icmp_signed("<", next_offset, tile_bytes), loop, done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(cache, block_id, kv_head), codegen
