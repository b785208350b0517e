"""Atomic operations on int64 numpy arrays for numba nopython code.

numba has no atomics, and a spin on a plain array read never ends: LLVM proves the loop body does
not write the element and hoists the load out of the loop. These intrinsics emit LLVM's atomic
instructions directly, so every flag read is a real load with a stated ordering.

All of them take a 1-D int64 array `arr` and an element index `i` (not bounds-checked, no negative
indices). They are usable only from jitted code (`@njit`, including `nogil=True` and `cache=True`
functions); from Python, wrap them in a small `@njit` function.

On x86-64 acquire loads and release stores compile to plain `mov`s (the hardware is TSO); the
orderings still matter because they forbid the *compiler* from reordering or hoisting.
fetch_add and compare_exchange compile to `lock xadd` / `lock cmpxchg`, full barriers on x86.
"""

from __future__ import annotations

import llvmlite.binding
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

# The `pause` inline asm below goes through LLVM's native asm parser; without this call a cold
# numba cache aborts the whole process ("Inline asm not supported by this streamer").
llvmlite.binding.initialize_native_asmparser()

_INT64_ALIGN = 8
CACHE_LINE_BYTES = 64
WORDS_PER_CACHE_LINE = CACHE_LINE_BYTES // 8


def cache_aligned_zeros(shape: int | tuple[int, ...], dtype: type[np.generic] = np.int64) -> np.ndarray:
    """A zeroed C-contiguous array of `shape` (int64 words unless `dtype` says otherwise) starting on a
    64-byte boundary, so that words meant to own a cache line really do (numpy only promises 16-byte
    alignment), and so that timings do not depend on where the allocator put an operand."""
    num_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    storage = np.zeros(num_bytes + CACHE_LINE_BYTES, dtype=np.uint8)
    offset = -storage.ctypes.data % CACHE_LINE_BYTES
    return storage[offset : offset + num_bytes].view(dtype).reshape(shape)


def _check_int64_array(arr_type: types.Type) -> None:
    if not (isinstance(arr_type, types.Array) and arr_type.dtype == types.int64 and arr_type.ndim == 1):
        raise TypingError(f"atomics need a 1-D int64 array, got {arr_type}")


def _element_pointer(context, builder, arr_type, arr_value, index_type, index_value) -> ir.Value:
    """Pointer to `arr[index]` (no wraparound: negative indices are a bug here)."""
    array = context.make_array(arr_type)(context, builder, arr_value)
    index = context.cast(builder, index_value, index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, arr_type, array, [index], wraparound=False)


@intrinsic
def load_acquire(typingctx, arr, i):
    """`arr[i]`, as an acquire load: later reads and writes cannot move before it.

    Pairs with `store_release`: if this load sees the released value, it also sees every write
    the releasing thread made before its store.
    """
    _check_int64_array(arr)

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, arr, args[0], i, args[1])
        # acquire: the consumer side of message passing; never hoisted out of a loop.
        return builder.load_atomic(pointer, ordering="acquire", align=_INT64_ALIGN)

    return types.int64(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i, value):
    """`arr[i] = value`, as a release store: earlier reads and writes cannot move after it."""
    _check_int64_array(arr)

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, arr, args[0], i, args[1])
        new_value = context.cast(builder, args[2], value, types.int64)
        # release: the producer side of message passing; publishes everything written before it.
        builder.store_atomic(new_value, pointer, ordering="release", align=_INT64_ALIGN)
        return context.get_dummy_value()

    return types.none(arr, i, value), codegen


@intrinsic
def fetch_add(typingctx, arr, i, value):
    """Atomically `arr[i] += value`; returns the value *before* the add."""
    _check_int64_array(arr)

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, arr, args[0], i, args[1])
        delta = context.cast(builder, args[2], value, types.int64)
        # acq_rel: a read-modify-write that both publishes our earlier writes and sees those
        # published by whoever added before us (needed by counters that hand over work).
        return builder.atomic_rmw("add", pointer, delta, ordering="acq_rel")

    return types.int64(arr, i, value), codegen


@intrinsic
def compare_exchange(typingctx, arr, i, expected, desired):
    """Atomically: if `arr[i] == expected`, set it to `desired`. Returns the OLD value of `arr[i]`.

    The exchange happened exactly when the returned value equals `expected` (C++'s
    `compare_exchange_strong`, returning the observed value instead of a bool).
    """
    _check_int64_array(arr)

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, arr, args[0], i, args[1])
        expected_value = context.cast(builder, args[2], expected, types.int64)
        desired_value = context.cast(builder, args[3], desired, types.int64)
        # acq_rel on success (a lock hand-over both acquires and releases); acquire on failure
        # so the observed value can be acted upon.
        old_and_success = builder.cmpxchg(
            pointer, expected_value, desired_value, ordering="acq_rel", failordering="acquire"
        )
        return builder.extract_value(old_and_success, 0)

    return types.int64(arr, i, expected, desired), codegen


@intrinsic
def fence_seq_cst(typingctx):
    """A full sequentially consistent fence (`mfence` on x86).

    Needed where a store must be ordered before a *later load of another location* (Dekker's
    pattern, e.g. "announce I am going to sleep, then re-check for work"): release/acquire alone
    allows that store-load reordering, and x86's store buffer really does it.
    """

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def cpu_pause(typingctx):
    """The x86 `pause` spin-loop hint: frees pipeline resources for the sibling hyperthread and
    avoids the memory-order mis-speculation flush when the awaited line finally changes.

    `sideeffect` stops LLVM from deleting it as dead code; it is not a memory barrier.
    """

    def codegen(context, builder, signature, args):
        pause = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "pause", "", side_effect=True)
        builder.call(pause, [])
        return context.get_dummy_value()

    return types.none(), codegen
