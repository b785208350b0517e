"""Weights as stored: quantized matrices stay quantized, float ones keep their dtype.

Conventions shared by every loader and kernel:
- a matrix is (out_features, in_features): row r produces output r, as in ggml and torch;
- query and key rows are in the order the file has them: ggml's llama files pair adjacent
  dimensions (2i, 2i+1) for RoPE, every other source pairs (i, i + head_dim/2)
  (`ModelConfig.rope_neox` says which);
- RMSNorm weights are what multiplies the normalised row: Gemma's (1 + w) is folded in at load,
  as llama.cpp's converter does;
- a mixture of experts keeps each projection's experts as one matrix of n_experts · rows rows,
  expert e's rows e·rows .. (e+1)·rows − 1, as a GGUF file stores its 3-D expert tensors.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .quant import BLOCK_SHAPES, QType, dequantize, row_bytes


@dataclass(frozen=True, slots=True)
class WeightMatrix:
    qtype: QType
    n_rows: int
    n_cols: int
    data: np.ndarray  # quantized: (n_rows, row_bytes) uint8; F32: float32, F16: float16, BF16: uint16, (n_rows, n_cols)

    def __post_init__(self) -> None:
        if self.qtype in BLOCK_SHAPES:
            expected = (self.n_rows, row_bytes(self.qtype, self.n_cols))
        else:
            expected = (self.n_rows, self.n_cols)
        if tuple(self.data.shape) != expected:
            raise ValueError(f"{self.qtype.name} matrix data has shape {self.data.shape}, expected {expected}")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 (n_rows, n_cols)."""
        return dequantize(self.data, self.qtype, self.n_cols)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """float32 (len(rows), n_cols), touching only the requested rows (embedding lookups)."""
        return dequantize(self.data[rows], self.qtype, self.n_cols)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: np.ndarray  # (dim,) float32
    wq: WeightMatrix  # (n_heads·head_dim, dim)
    wk: WeightMatrix  # (n_kv_heads·head_dim, dim)
    wv: WeightMatrix  # (n_kv_heads·head_dim, dim)
    wo: WeightMatrix  # (dim, n_heads·head_dim)
    ffn_norm: np.ndarray  # (dim,) float32
    w_gate: WeightMatrix  # (hidden_dim, dim); stacked (n_experts · hidden_dim, dim) in a mixture of experts
    w_up: WeightMatrix  # (hidden_dim, dim); stacked likewise
    w_down: WeightMatrix  # (dim, hidden_dim); stacked (n_experts · dim, hidden_dim)
    # present only where the architecture has them (see ModelConfig's switches)
    q_bias: np.ndarray | None = None  # (n_heads·head_dim,) float32
    k_bias: np.ndarray | None = None  # (n_kv_heads·head_dim,)
    v_bias: np.ndarray | None = None  # (n_kv_heads·head_dim,)
    q_norm: np.ndarray | None = None  # (head_dim,) RMSNorm weight shared by every query head
    k_norm: np.ndarray | None = None  # (head_dim,)
    post_attn_norm: np.ndarray | None = None  # (dim,) on the attention output, before the residual add
    post_ffn_norm: np.ndarray | None = None  # (dim,) on the feed-forward output, before the residual add
    router: np.ndarray | None = None  # (n_experts, dim) float32: each expert's score row, in a mixture of experts


@dataclass(frozen=True, slots=True)
class ModelWeights:
    token_embedding: WeightMatrix  # (vocab, dim)
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray  # (dim,) float32
    lm_head: WeightMatrix  # (vocab, dim); the same object as token_embedding when tied

    @property
    def nbytes(self) -> int:
        """Bytes of every layer matrix plus the LM head: what a dense model reads per decode step
        (a mixture of experts reads less: decoding.kernels.forward.bytes_read_per_token)."""
        mats = [self.lm_head] + [m for layer in self.layers for m in _matrices(layer)]
        return sum(m.nbytes for m in mats)

    def storage_types(self) -> dict[str, int]:
        """How many matrices are held in each storage type (the embedding and an untied head count
        once each), most common first: what a file's mix of types became once loaded."""
        mats = [m for layer in self.layers for m in _matrices(layer)] + [self.token_embedding]
        if self.lm_head is not self.token_embedding:
            mats.append(self.lm_head)
        counts: dict[str, int] = {}
        for m in mats:
            counts[m.qtype.name] = counts.get(m.qtype.name, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def release_mapped_pages(array: np.ndarray) -> bool:
    """Drop this process's resident copy of the file pages under `array`; False if it is not file-mapped.

    For a caller that has made its own copy of what it reads every step (the fast kernels' repacked
    matrices): the stored matrix is then read only for a few embedding rows a step, yet repacking
    touched all of it, and a touched file page counts in the process's RSS for as long as it stays
    mapped. The pages stay in the page cache and a later read faults them back in, so nothing is
    lost. Only read-only maps qualify: a copy-on-write or anonymous page would lose its contents.
    Pages shared with a neighbouring array are kept (only whole pages inside `array` go).
    """
    if _backing_map(array) is None or not array.flags.c_contiguous:
        return False
    begin = -(-array.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (array.ctypes.data + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > begin and _libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), mmap.MADV_DONTNEED):
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a weight map")
    return True


def release_file_maps(arrays: Iterable[np.ndarray]) -> None:
    """Drop this process's resident copy of every read-only file map under `arrays`, each map whole
    (arrays that map no file, or a writable one, are passed over).

    For a caller that has copied or repacked all it reads every step: the fast kernels' model, whose
    norms and biases are read at load, and whose file pages around them then stay mapped, however
    small the tensor — a whole large page-cache folio each where the kernel keeps the file in them
    (120 MiB of the Qwen2.5-7B shape's file at start, 2 MiB a fault). A page still read (a matrix the
    float path serves) faults back from the page cache, unchanged.
    """
    seen = set()
    for array in arrays:
        backing = _backing_map(array)
        if backing is None or id(backing) in seen:
            continue
        seen.add(id(backing))
        whole = np.frombuffer(backing, dtype=np.uint8)
        if whole.size and _libc.madvise(ctypes.c_void_p(whole.ctypes.data), ctypes.c_size_t(whole.size),
                                        mmap.MADV_DONTNEED):  # fmt: skip
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a model file's map")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def release_freed_heap() -> None:
    """Return the C heap's freed pages to the system (glibc's malloc_trim), after a load.

    Parsing a GGUF's metadata makes hundreds of thousands of small objects (a 150k-token vocabulary
    and its merges) that are freed once the tokenizer is built; glibc keeps their pages, scattered
    through the heap, resident for the life of the process (30 MB for Qwen2.5's vocabulary) unless
    asked to give them back. A no-op where the C library has no malloc_trim.
    """
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        gc.collect()
        trim(0)


def _backing_map(array: np.ndarray) -> mmap.mmap | None:
    """The read-only memory map an array views (through any chain of views), or None."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    if not isinstance(base, mmap.mmap):
        return None
    with memoryview(base) as view:
        return base if view.readonly else None


def _matrices(layer: LayerWeights) -> tuple[WeightMatrix, ...]:
    return (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down)
