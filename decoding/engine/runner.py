"""The runner: turns a scheduled step into the kernel's arrays and runs the model step on the pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcache.batch import KVBatchArrays
from kvcache.storage import KVCacheStorage
from threadpool import SpinPool

from ..kernels.forward import (
    KERNEL_MODES,
    Architecture,
    KernelWeights,
    StepInputs,
    StepScratch,
    int8_kernels,
    model_step,
    tile_mode,
)
from ..kernels.phases import no_profile, phase_counters
from ..model.model import Model


@dataclass(slots=True)
class StepBatch:
    """One step's flat batch: the rows of every scheduled sequence, back to back."""

    token_ids: np.ndarray  # (num_tokens,) int32
    kv: KVBatchArrays  # positions, slot mapping, block tables, context lengths, query starts
    logit_rows: np.ndarray  # (num_logit_rows,) int32: rows whose logits are needed, then the pooled rows
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    num_pooled_rows: int = 0  # the last of `logit_rows`: final-normed for an embedding, no logits

    @property
    def num_head_rows(self) -> int:
        return int(self.logit_rows.shape[0]) - self.num_pooled_rows

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class ModelRunner:
    def __init__(self, model: Model, storage: KVCacheStorage, pool: SpinPool, max_num_tokens: int,
                 max_logit_rows: int, kernels: str = "fast", weights: KernelWeights | None = None) -> None:
        """`weights`: the model's kernel weights if already built (KernelWeights.build), else built here."""
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
        cfg = model.config
        self.kernels = kernels
        self.config = cfg
        self.storage = storage
        self.pool = pool
        self.max_num_tokens = max_num_tokens
        self.max_logit_rows = max_logit_rows
        self.weights = weights or KernelWeights.build(cfg, model.weights, fast=int8_kernels(kernels))
        self.architecture = Architecture.of(cfg)
        self.state = StepScratch.allocate(cfg, max_num_tokens, max_logit_rows, pool.n_threads,
                                          storage.spec.block_size, tile_mode(kernels))

    @property
    def phase_cycles(self) -> np.ndarray | None:
        """Cycles each phase of `PHASES` took over the steps since profiling began; None when off."""
        return self.state.phase_cycles if self.state.phase_cycles.shape[0] else None

    def profile_phases(self, on: bool) -> None:
        """Start timing each phase of every step from zero (`phase_cycles`), or stop."""
        self.state = self.state._replace(phase_cycles=phase_counters() if on else no_profile())

    def forward(self, batch: StepBatch, storage: KVCacheStorage | None = None) -> np.ndarray:
        """Run one step; returns logits (num_head_rows, vocab), a view valid until the next step (the
        pooled rows' final hidden states are in `pooled_rows`). `storage`: KV arrays of the same spec
        to use instead of the runner's own (a calibration's)."""
        storage = storage or self.storage
        if not 0 < batch.num_tokens <= self.max_num_tokens:
            raise ValueError(f"a step holds 1..{self.max_num_tokens} tokens, got {batch.num_tokens}")
        if batch.logit_rows.shape[0] > self.max_logit_rows:
            raise ValueError(f"a step samples at most {self.max_logit_rows} rows")
        if batch.block_copies:
            storage.copy_blocks(batch.block_copies)
        kv = batch.kv
        w = self.weights
        step = StepInputs(token_ids=batch.token_ids, embedding_rows=w.token_rows.gather(batch.token_ids),
                          positions=kv.positions, slot_mapping=kv.slot_mapping,
                          block_tables=kv.block_tables, context_lens=kv.context_lens,
                          query_start_loc=kv.query_start_loc, logit_rows=batch.logit_rows,
                          num_head_rows=batch.num_head_rows)
        w.cover_positions(step.positions)
        self.pool.run(model_step, int8_kernels(self.kernels), step, w.matrices, w.packed, w.arrays, self.architecture,
                      storage.key_cache, storage.value_cache, self.state)
        return self.state.logits[: batch.num_head_rows]

    def set_key_centres(self, centres: np.ndarray) -> None:
        """Subtract `centres` (n_layers, kv_dim) from every key an int8 cache stores (kvcache.key_centres)."""
        arrays = self.weights.arrays
        if centres.shape != arrays.key_centres.shape:
            raise ValueError(f"key centres of shape {centres.shape}; this model's are {arrays.key_centres.shape}")
        self.weights.arrays = arrays._replace(key_centres=np.ascontiguousarray(centres, dtype=np.float32))

    def pooled_rows(self, batch: StepBatch) -> np.ndarray:
        """The final-normed hidden states of the batch's pooled rows (num_pooled_rows, dim), after
        `forward`; a view valid until the next step."""
        return self.state.final[batch.num_head_rows : batch.logit_rows.shape[0]]
