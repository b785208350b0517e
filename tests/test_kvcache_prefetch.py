"""The KV tiles' software prefetch: what it asks the CPU for (it changes no value)."""

from __future__ import annotations

import re

import numpy as np
from numba import njit

from kvcache.prefetch import prefetch_tile


@njit  # not cached: numba keeps no assembly for cached code
def _ask_for(tile):  # type: ignore[no-untyped-def]
    prefetch_tile(tile)


def _prefetches(tile: np.ndarray) -> list[str]:
    _ask_for(tile)
    asm = _ask_for.inspect_asm(_ask_for.signatures[-1])
    return re.findall(r"\bprefetch\w*", asm)


def test_a_tile_is_asked_into_l2_not_l1() -> None:
    """Into L1 (`prefetcht0`) a block's 68-256 line requests overran the L1's miss buffers and long
    contexts' attention ran 35-50% slower on a Zen 4 guest than with the lines brought to L2
    (`prefetcht1`)."""
    for dtype in (np.int8, np.uint16, np.float32):
        asked = _prefetches(np.zeros((136, 16), dtype))
        assert asked and set(asked) == {"prefetcht1"}, (dtype, asked)
