"""Measures an int8 KV cache's key centres (kvcache.key_centres) through the model's own step, once
per model, configuration and code, and keeps them beside the weight cache."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from kvcache import key_centres
from kvcache.batch import KVBatchArrays
from kvcache.storage import KVCacheStorage

from ..model.tokenizer import Tokenizer
from .runner import ModelRunner, StepBatch

log = logging.getLogger(__name__)


def prefill_alone(runner: ModelRunner, token_ids: list[int], every_row: bool = False
                  ) -> tuple[np.ndarray, KVCacheStorage]:  # fmt: skip
    """Prefill `token_ids` as one sequence into a cache of the runner's spec of its own (blocks 0, 1, ...),
    in steps of at most the runner's tokens. Returns a copy of the logits (of every row where
    `every_row`, which must fit one step; else of the last row) and the cache."""
    spec = runner.storage.spec
    num_tokens = len(token_ids)
    block_ids = np.arange(-(-num_tokens // spec.block_size), dtype=np.int32)
    storage = KVCacheStorage.allocate(spec, len(block_ids))
    ids = np.asarray(token_ids, dtype=np.int32)
    step = num_tokens if every_row else runner.max_num_tokens
    for start in range(0, num_tokens, step):
        end = min(num_tokens, start + step)
        positions = np.arange(start, end, dtype=np.int32)  # blocks 0, 1, ...: a position is its slot
        kv = KVBatchArrays(block_tables=block_ids[None, :], context_lens=np.array([end], np.int32),
                           query_start_loc=np.array([0, end - start], np.int32), positions=positions,
                           slot_mapping=positions.copy())  # fmt: skip
        rows = np.arange(end - start, dtype=np.int32) if every_row else np.array([end - start - 1], np.int32)
        logits = runner.forward(StepBatch(ids[start:end], kv, logit_rows=rows), storage)
    return logits.copy(), storage


def measure_key_centres(runner: ModelRunner, token_ids: list[int]) -> np.ndarray:
    """The mean stored key of each layer and KV head of `token_ids` prefilled with no centres."""
    runner.set_key_centres(np.zeros_like(runner.weights.arrays.key_centres))
    if len(token_ids) <= key_centres.SKIPPED_POSITIONS:  # nothing to average: keys stored whole
        return runner.weights.arrays.key_centres
    _, storage = prefill_alone(runner, token_ids)
    return key_centres.centres_from_cache(storage, np.arange(storage.num_blocks), len(token_ids))


def calibration_tokens(tokenizer: Tokenizer, max_positions: int) -> list[int]:
    return tokenizer.encode(key_centres.CALIBRATION_TEXT)[: min(key_centres.CALIBRATION_TOKENS, max_positions)]


def centre_keys(runner: ModelRunner, tokenizer: Tokenizer, cache: Path | None) -> None:
    """Give the runner its key centres: those kept at `cache` where there are, else measured on the
    calibration text, as far as the model has positions (and kept there where `cache` is a path)."""
    shape = runner.weights.arrays.key_centres.shape
    centres = key_centres.load(cache, shape) if cache is not None else None
    if centres is not None:
        log.info("int8 KV cache: key centres from %s", cache)
    else:
        started = time.perf_counter()
        token_ids = calibration_tokens(tokenizer, runner.config.max_context)
        centres = measure_key_centres(runner, token_ids)
        log.info("int8 KV cache: key centres measured on %d tokens in %.1f s", len(token_ids),
                 time.perf_counter() - started)  # fmt: skip
        if cache is not None:
            try:
                key_centres.save(cache, centres)
            except OSError as error:
                log.warning("could not keep the key centres at %s: %s", cache, error)
    runner.set_key_centres(centres)
