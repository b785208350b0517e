"""Where a model step's time goes: the time-stamp counter read at every barrier of `model_step`.

Profiling is opt-in per runner (`ModelRunner.profile_phases`): thread 0 adds the cycles from one
barrier to the next to the phase that ran between them, so each phase's figure is its slowest thread's
work plus the wait for it — the step's wall time, split. Off, the step reads no counter.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

PHASES = (
    "embed",
    "attention norm + quantize",
    "q k v projections",
    "biases, head norms, rope",
    "kv cache write",
    "paged attention",
    "quantize attention",
    "output projection",
    "ffn norm + quantize",
    "gather expert rows",
    "gate, up, activation",
    "quantize hidden",
    "down projection",
    "combine experts",
    "post-norms",
    "final norm + quantize",
    "lm head",
)
(EMBED, ATTENTION_NORM, QKV, ROPE, KV_WRITE, ATTENTION, QUANTIZE_ATTENTION, OUTPUT_PROJECTION, FFN_NORM,
 GATHER_EXPERTS, GATE_UP, QUANTIZE_HIDDEN, DOWN_PROJECTION, COMBINE_EXPERTS, POST_NORMS, FINAL_NORM,
 LM_HEAD) = range(len(PHASES))  # fmt: skip


@intrinsic
def cycle_counter(typingctx):
    """The CPU's time-stamp counter (`llvm.readcyclecounter`: rdtsc on x86-64)."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(nogil=True, cache=True, inline="always")
def lap(phase_cycles, phase, since):
    """Adds the cycles since `since` to `phase` where profiling is on; the counter now (0 where off)."""
    if phase_cycles.shape[0] == 0:
        return 0
    now = cycle_counter()
    phase_cycles[phase] += now - since
    return now


def no_profile() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def phase_counters() -> np.ndarray:
    return np.zeros(len(PHASES), dtype=np.int64)
