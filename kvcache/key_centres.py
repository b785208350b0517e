"""Key centres of an int8 KV cache: a vector per layer and KV head subtracted from every key before
it is quantized.

A model's keys share a large common part — on Qwen2.5 the mean key of a head is 65-85% of its keys'
RMS (the K bias, and channels that RoPE barely turns) — and an int8 group's scale is set by its
largest value, so that common part leaves the rest of the key a few steps of the grid. Subtracting a
fixed vector c from every key of a (layer, KV head) changes every score of a query by the same q·c,
which the softmax removes: attention is unchanged in exact arithmetic, and the stored residual k − c
is quantized on a finer grid (the idea of SageAttention's smoothed K; values are not centred, which
measured no better).

c must be the same for every key a query ever meets, and for every block any prefix-cache tier holds
under the same namespace: it is measured once per model, configuration and code, by prefilling a fixed
text through the model's own step with c = 0, as the mean of the stored keys past the first few
positions (`SKIPPED_POSITIONS`: attention sinks are unlike the rest). The step is bit-identical across
threads, batches and prompt chunks, so every server of a configuration measures the same c.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import numpy as np

from kvcache.storage import Q8_GROUP, KVCacheStorage

log = logging.getLogger(__name__)

# Prose, code and a chat turn: the mean key barely depends on the text (Qwen2.5-Coder-0.5B's
# agreement with float16 moved by less than 0.3 points between 128 and 1,024 tokens of other text).
CALIBRATION_TEXT = (
    "The river rose in the night, and by morning the lower fields were under a hand's depth of brown "
    "water. The weaver carried her loom to the loft, counted the threads twice, and went back to work.\n\n"
    "def moving_average(values, width):\n"
    "    \"\"\"The mean of each window of `width` consecutive values.\"\"\"\n"
    "    total = sum(values[:width])\n"
    "    out = [total / width]\n"
    "    for i in range(width, len(values)):\n"
    "        total += values[i] - values[i - width]\n"
    "        out.append(total / width)\n"
    "    return out\n\n"
    "User: What is the capital of Australia, and why was it chosen?\n"
    "Assistant: Canberra. It was built as a compromise between Sydney and Melbourne, which both wanted "
    "to be the capital when the colonies federated in 1901."
)
CALIBRATION_TOKENS = 128
SKIPPED_POSITIONS = 4
SUFFIX = ".key-centres.npy"
_DIGEST_BYTES = 8


def dequantize_keys(key_tiles: np.ndarray, head_dim: int) -> np.ndarray:
    """An int8 cache's K tiles (..., head_dim + 2·groups, block_size) as float32 keys
    (..., block_size, head_dim): each stored byte k + 128 back to k, times its group's fp16 scale."""
    *lead, row_width, block_size = key_tiles.shape
    flat = np.ascontiguousarray(key_tiles).reshape(*lead, row_width * block_size)
    values = flat[..., : head_dim * block_size].view(np.uint8).astype(np.float32) - 128.0
    # byte (d // 4)·4·block_size + 4·t + d % 4
    values = values.reshape(*lead, head_dim // 4, block_size, 4).swapaxes(-3, -2).reshape(*lead, block_size, head_dim)
    groups = head_dim // Q8_GROUP
    scales = flat[..., head_dim * block_size : (head_dim + 2 * groups) * block_size].view(np.float16)
    scales = scales.reshape(*lead, groups, block_size).swapaxes(-2, -1).astype(np.float32)  # (..., t, group)
    return values * np.repeat(scales, Q8_GROUP, axis=-1)


def centres_from_cache(storage: KVCacheStorage, block_ids: np.ndarray, num_tokens: int) -> np.ndarray:
    """(n_layers, n_kv_heads · head_dim) float32: the mean key of positions SKIPPED_POSITIONS..num_tokens
    of a sequence stored in `block_ids` of an int8 cache."""
    spec = storage.spec
    tiles = storage.key_cache[:, :, block_ids]  # (layers, heads, blocks, row_width, block_size)
    keys = dequantize_keys(tiles, spec.head_dim)  # (layers, heads, blocks, block_size, head_dim)
    keys = keys.reshape(spec.n_layers, spec.n_kv_heads, -1, spec.head_dim)
    centres = keys[:, :, SKIPPED_POSITIONS:num_tokens].mean(axis=2, dtype=np.float64)
    return centres.reshape(spec.n_layers, -1).astype(np.float32)


def cache_path(directory: Path, model_path: Path, configuration: str, namespace: bytes) -> Path:
    """Where a model's measured centres are kept: `configuration` a readable name of what they depend on
    beside the model file (the files of older code under the same name are removed when a new one is
    kept), `namespace` the prefix tiers' hash of everything they depend on (the model file, the
    configuration, the KV code, this module included)."""
    return directory / f"{model_path.stem}.{configuration}.{namespace[:_DIGEST_BYTES].hex()}{SUFFIX}"


def load(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """The centres kept at `path`, or None where there are none of this shape (absent, foreign, torn)."""
    try:
        centres = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        if path.exists():
            log.warning("ignoring unreadable key centres %s: %s", path, error)
        return None
    if centres.shape != shape or centres.dtype != np.float32 or not np.all(np.isfinite(centres)):
        log.warning("ignoring key centres %s: shape %s %s, expected %s float32", path, centres.shape, centres.dtype,
                    shape)  # fmt: skip
        return None
    return centres


def save(path: Path, centres: np.ndarray) -> None:
    """Write beside then rename: a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as file:
        np.save(file, centres, allow_pickle=False)
    os.replace(partial, path)
    stem = path.name[: path.name.rindex(".", 0, len(path.name) - len(SUFFIX)) + 1]  # model and configuration
    for older in path.parent.glob(glob.escape(stem) + "?" * 2 * _DIGEST_BYTES + SUFFIX):
        if older != path:
            older.unlink(missing_ok=True)
            log.info("removed %s, the key centres of older code", older)
