"""The KV arrays: allocated once at start, sized from a memory budget, never resized per request.

Layout, chosen for `attention.paged_attention_rows`, which for a query row and a KV head walks the
sequence's blocks and, per block, computes `block_size` scores and then a weighted sum of
`block_size` value rows:

    key_cache:   (n_layers, n_kv_heads, num_blocks, head_dim, block_size)   K transposed per block
    value_cache: (n_layers, n_kv_heads, num_blocks, block_size, head_dim)

- Both are C-contiguous, float32, half floats or int8 (`KVCacheSpec.dtype`; numba has no float16 arrays on
  the CPU, so half floats are stored as their uint16 bits and converted in the kernels, see
  `kvcache.fastmath`); one layer's slice `key_cache[layer]` is what a kernel gets. Half floats halve
  the bytes a decode reads per token of context and double the tokens a budget holds, as fp16 KV does
  in llama.cpp (its default) and vLLM; attention's arithmetic stays float32 either way.
- One (KV head, block) tile of either is contiguous (block_size * head_dim elements, 4 KiB in float32
  at 16 x 64),
  so the kernel streams whole tiles and every query head of a GQA group reuses them from L1.
- A KV head's blocks lie one after another: the step's threads each serve KV heads, and a sequence's
  blocks, allocated in order, are then one stream per thread, which the kernel's own requests keep
  ahead of (with the heads of a block side by side instead, a thread read every other tile: the 1.5B
  shape's int8 attention at 32k keys took 7-70% longer a block on two threads, in six alternated runs).
- Keys are transposed within the tile so that the scores of a block are `block_size` independent
  sums: the loop over head_dim is outside, the loop over the block's keys inside and contiguous. It
  vectorises without reassociating any sum (fastmath stays off: results are bit-reproducible), the
  same reason vLLM gives its key cache a different layout from its value cache.
- Values keep head_dim innermost: the weighted sum adds `p * v` rows, contiguous over head_dim.
- int8 (llama.cpp's q8_0 cache): each token's K and V of a head are quantized when written, in groups of
  Q8_GROUP values with a fp16 scale each (`scale = max|x| / 127`, `q = round(x / scale)`), 136 bytes
  for head_dim 128 where float16 takes 256. The scales travel inside the tile, so the arrays keep one
  element type and a tile stays one contiguous read. Its head_dim · block_size values come first,
  laid out as the operands of `vpdpbusd` (which multiplies four bytes by four bytes in each 32-bit
  lane), then its scales as a (groups, block_size) fp16 array. A K tile, shaped (head_dim + 2·groups,
  block_size), keeps each key's four bytes of a quad of dimensions together, as the unsigned k + 128
  (byte (d // 4)·4·block_size + 4·t + d % 4); a V tile, shaped (block_size, row_width) but not
  stored by rows, keeps each quad of keys' four bytes of a dimension together (byte
  (t // 4)·4·head_dim + 4·d + t % 4). An int8 cache's blocks are a multiple of 4 keys.
The KV write for a new token is one strided store per key element: a few per token, against a
whole context read per query.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvcache.errors import KVCacheError

MIB = 1 << 20
# stored type of each KV cache dtype: half floats travel as their IEEE bit patterns
KV_STORAGE_TYPES = {"float32": np.float32, "float16": np.uint16, "int8": np.int8}
Q8_GROUP = 32  # int8 KV: values sharing one scale, as in llama.cpp's q8_0 cache


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one block, from the model's hyperparameters (defaults: SmolLM2-135M)."""

    n_layers: int = 30
    n_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"  # or "float16"

    def __post_init__(self) -> None:
        if self.dtype not in KV_STORAGE_TYPES:
            raise KVCacheError(f"KV cache dtype must be one of {', '.join(KV_STORAGE_TYPES)}, got {self.dtype!r}")
        if self.dtype == "int8" and self.head_dim % Q8_GROUP:
            raise KVCacheError(f"an int8 KV cache needs head_dim a multiple of {Q8_GROUP}, got {self.head_dim}")
        if self.dtype == "int8" and self.block_size % 4:
            raise KVCacheError(f"an int8 KV cache stores its values by quads of keys: block_size must be a multiple "
                               f"of 4, got {self.block_size}")  # fmt: skip

    @property
    def storage_type(self) -> type:
        return KV_STORAGE_TYPES[self.dtype]

    @property
    def row_width(self) -> int:
        """Elements of one token's K (or V) for one head: head_dim, and for int8 the fp16 scale of each
        group of Q8_GROUP values after them (two bytes each)."""
        return self.head_dim + (2 * self.head_dim // Q8_GROUP if self.dtype == "int8" else 0)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token on every layer (46,080 B for the default model in float32, half in float16,
        53% of float16 in int8)."""
        element_bytes = np.dtype(self.storage_type).itemsize
        return self.n_layers * 2 * self.n_kv_heads * self.row_width * element_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_mib(self, kv_cache_mb: float) -> int:
        """How many whole blocks fit in `kv_cache_mb` MiB (1 GiB holds 1456 default blocks)."""
        num_blocks = int(kv_cache_mb * MIB) // self.bytes_per_block
        if num_blocks < 1:
            raise KVCacheError(
                f"{kv_cache_mb} MiB holds no KV block of {self.bytes_per_block / MIB:.2f} MiB; raise kv_cache_mb"
            )
        return num_blocks


@dataclass(slots=True)
class KVCacheStorage:
    """Every layer's K and V for `num_blocks` blocks."""

    spec: KVCacheSpec
    key_cache: np.ndarray  # (n_layers, n_kv_heads, num_blocks, head_dim, block_size) spec.storage_type
    value_cache: np.ndarray  # (n_layers, n_kv_heads, num_blocks, block_size, head_dim) spec.storage_type

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int) -> KVCacheStorage:
        """Allocate and touch every page now, so that no step pays page faults and an over-large
        budget fails at start rather than when the cache fills up under load."""
        key_cache = np.empty(
            (spec.n_layers, spec.n_kv_heads, num_blocks, spec.row_width, spec.block_size), dtype=spec.storage_type
        )
        value_cache = np.empty(
            (spec.n_layers, spec.n_kv_heads, num_blocks, spec.block_size, spec.row_width), dtype=spec.storage_type
        )
        # +0.0 in either type; the two arrays' pages are first touched on two threads at once (numpy's
        # fill runs without the GIL), which is most of a start's time for a KV budget of a few GiB
        with ThreadPoolExecutor(2) as touch:
            list(touch.map(lambda array: array.fill(0), (key_cache, value_cache)))
        return cls(spec, key_cache, value_cache)

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, kv_cache_mb: float) -> KVCacheStorage:
        return cls.allocate(spec, spec.num_blocks_for_mib(kv_cache_mb))

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[2]

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Perform the manager's copy-on-write copies (src, dst) on every layer.

        Run before the step's KV writes: a copy's source may be released by then, but nothing
        overwrites it until the writes.
        """
        for src_block_id, dst_block_id in copies:
            self.key_cache[:, :, dst_block_id] = self.key_cache[:, :, src_block_id]
            self.value_cache[:, :, dst_block_id] = self.value_cache[:, :, src_block_id]
