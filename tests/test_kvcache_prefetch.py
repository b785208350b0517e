"""The KV tiles' software prefetch: what it asks the CPU for (it changes no value)."""

from __future__ import annotations

import re

import numpy as np
from numba import njit

from kvcache.attention import attention_scratch
from kvcache.attention_simd import attend_heads, int8_tile_lines
from kvcache.prefetch import prefetch_tile
from kvcache.storage import KVCacheSpec


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


@njit  # not cached: numba keeps no assembly for cached code
def _attend_int8(work, key_cache, value_cache):  # type: ignore[no-untyped-def]
    attend_heads(work, 0, 2, 128, key_cache, value_cache, 0, 0, 16, 1, 0)


@njit  # not cached: numba keeps no assembly for cached code
def _attend_int8_pair(work, key_cache, value_cache):  # type: ignore[no-untyped-def]
    attend_heads(work, 0, 2, 128, key_cache, value_cache, (0, 1), 0, (16, 16), (2, 3), 0)


def test_an_int8_call_asks_for_every_line_of_later_blocks_tiles() -> None:
    """The int8 vector IR asks for block `prefetch_block`'s K and V tiles from its own loops: one
    `prefetcht1` per line of each (34 for head_dim 128: 2,048 bytes of keys or values and 128 of
    scales), none into L1; a call of two blocks, for two later blocks' tiles."""
    spec = KVCacheSpec(n_layers=1, n_kv_heads=1, head_dim=128, block_size=16, dtype="int8")
    key_cache = np.zeros((1, 4, spec.row_width, 16), np.int8)
    value_cache = np.zeros((1, 4, 16, spec.row_width), np.int8)
    assert int8_tile_lines(128) == 34
    for attend, blocks in ((_attend_int8, 1), (_attend_int8_pair, 2)):
        work = attention_scratch(1, 2, 1, 128, 16, rows_together=1)[0]
        work[:, 2 * 128 + 16] = -np.inf
        attend(work, key_cache, value_cache)
        asm = attend.inspect_asm(attend.signatures[-1])
        asked = re.findall(r"\bprefetch\w*", asm)
        assert asked == ["prefetcht1"] * 2 * blocks * int8_tile_lines(128), blocks
        # spread among the loads, not gathered: the longest run of requests back to back is a
        # tile's two lines of scales for each block
        instructions = [line.split()[0] for line in asm.splitlines() if re.match(r"\s+[a-z]", line)]
        runs = "".join("p" if name.startswith("prefetch") else "." for name in instructions).split(".")
        assert max(len(run) for run in runs) <= 2 * blocks, (blocks, sorted(map(len, runs))[-5:])


@njit  # not cached: numba keeps no assembly for cached code
def _attend_float(work, key_cache, value_cache):  # type: ignore[no-untyped-def]
    attend_heads(work, 0, 2, 128, key_cache, value_cache, 0, 0, 16, 1, 0)


def test_a_float_call_asks_for_a_later_blocks_tiles_from_its_loops() -> None:
    """A float cache's vector IR asks for block `prefetch_block`'s K tile a line beside each row of
    keys at that offset (64 lines of float16 at head_dim 128, 128 of float32), and its V tile's lines
    from the loop over keys of each pass (a line or two of each key's row a step), all into L2 and
    spread among the loads, not gathered."""
    for dtype, key_lines in ((np.uint16, 64), (np.float32, 128)):
        key_cache = np.zeros((1, 4, 128, 16), dtype)
        value_cache = np.zeros((1, 4, 16, 128), dtype)
        work = attention_scratch(1, 2, 1, 128, 16, rows_together=1)[0]
        work[:, 2 * 128 + 16] = -np.inf
        _attend_float(work, key_cache, value_cache)
        asm = _attend_float.inspect_asm(_attend_float.signatures[-1])
        asked = re.findall(r"\bprefetch\w*", asm)
        assert set(asked) == {"prefetcht1"} and len(asked) > key_lines, (dtype, len(asked))
        instructions = [line.split()[0] for line in asm.splitlines() if re.match(r"\s+[a-z]", line)]
        runs = "".join("p" if name.startswith("prefetch") else "." for name in instructions).split(".")
        assert max(len(run) for run in runs) <= 2, (dtype, sorted(map(len, runs))[-5:])
