"""The engine of an embedding model: requests of many inputs, packed into steps, each step one `pool.run`.

    submit(inputs) → the loop packs inputs under the step's token budget → the forward on the pool
        → each input's hidden states pooled (or scored) → the request's future once all of its are done

Two forwards: a BERT encoder's step (EncoderForward), or a generation model's own step run as an encoder
(DecoderForward, `--task embed`). Either keeps nothing between steps (every input is computed whole in one
step and pooled; a decoder's KV lives only for its step), so scheduling is packing. Each step takes inputs
from the requests in arrival order, one input per request in turn, until `max_num_batched_tokens` (an input
never spans steps): a request of 2,000 inputs is spread over many steps and a short request arriving behind it
shares the next one instead of waiting for the whole batch. Requests cancelled (the client left) drop their
inputs not yet computed. The thread parks while there is nothing to do, as the generation engine's does.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from kvcache.storage import KVCacheSpec, KVCacheStorage
from threadpool import SpinPool

from ..kernels import weight_cache
from ..kernels.encoder import EncoderArchitecture, EncoderInputs, EncoderKernelWeights, EncoderScratch, encoder_step
from ..kernels.forward import Architecture, KernelWeights, StepInputs, StepScratch, int8_kernels, model_step, tile_mode
from ..model.decoder_embedder import DecoderEmbedder
from ..model.encoder import EncoderConfig, EncoderModel, EncoderWeights
from .config import EngineConfig, resolve_kv_cache_dtype
from .errors import EngineFailed, EngineShuttingDown, QueueFull, RequestTooLarge

log = logging.getLogger(__name__)

EncoderInput = tuple[list[int], list[int]]  # token ids, token types


class InputTooLong(RequestTooLarge):
    """One input of a request has more tokens than the model's context."""

    def __init__(self, index: int, num_tokens: int, max_tokens: int) -> None:
        super().__init__(f"input {index} has {num_tokens} tokens; the model takes at most {max_tokens}")
        self.index = index


@dataclass(eq=False)
class EncodeRequest:
    request_id: str
    inputs: list[EncoderInput]
    future: concurrent.futures.Future[np.ndarray]
    outputs: np.ndarray  # (len(inputs), output_dim) float32, filled as steps compute them
    next_input: int = 0  # inputs before it are scheduled
    num_done: int = 0

    @property
    def is_cancelled(self) -> bool:
        return self.future.cancelled()

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.inputs)

    def resolve(self, outcome: np.ndarray | BaseException) -> None:
        """Set the result or exception unless the client cancelled the request meanwhile."""
        try:
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled between the check and now: nobody is waiting


@dataclass(slots=True)
class EncoderStats:
    num_steps: int = 0
    num_inputs: int = 0
    num_tokens: int = 0
    num_requests: int = 0


def pool_hidden(cfg: EncoderConfig, weights: EncoderWeights | None, hidden: np.ndarray,
                score_rows: np.ndarray | None = None) -> np.ndarray:
    """One input's output from its last hidden states (n, dim): the pooled (and normalised) vector of an
    embedder, a cross-encoder's scores (the [CLS] state through the pooler and classifier), or a decoder
    reranker's (its pooled state through `score_rows`: see finish_pooled)."""
    if cfg.task == "classify" and weights is not None:
        pooled = np.tanh(weights.pooler @ hidden[0] + weights.pooler_bias)
        scores = weights.classifier @ pooled + weights.classifier_bias
        return (1.0 / (1.0 + np.exp(-scores)) if cfg.sigmoid else scores).astype(np.float32)
    if cfg.pooling == "cls":
        vector = hidden[0]
    elif cfg.pooling == "last":
        vector = hidden[-1]
    else:
        vector = hidden.mean(axis=0, dtype=np.float32)
    return finish_pooled(cfg, vector, score_rows)


def finish_pooled(cfg: EncoderConfig, vector: np.ndarray, score_rows: np.ndarray | None = None) -> np.ndarray:
    """A pooled vector as the model's output: float32, L2-normalised where the model says so; or, for a
    decoder reranker, p(yes) of the softmax over its two logits (`score_rows`: yes, no)."""
    if score_rows is not None:
        yes, no = score_rows.astype(np.float64) @ vector.astype(np.float64)
        return np.array([1.0 / (1.0 + np.exp(no - yes))], dtype=np.float32)
    vector = vector.astype(np.float32)  # a copy: the step's scratch is written again next step
    if cfg.normalize:
        vector /= max(float(np.linalg.norm(vector)), 1e-12)  # sentence-transformers' F.normalize eps
    return vector


def validate_inputs(cfg: EncoderConfig, inputs: list[EncoderInput], max_tokens: int) -> None:
    """Raise InputTooLong (naming the input) or ValueError for inputs that could never be computed."""
    for index, (ids, types) in enumerate(inputs):
        if not ids:
            raise ValueError(f"input {index} is empty")
        if len(ids) > max_tokens:
            raise InputTooLong(index, len(ids), max_tokens)
        if len(types) != len(ids):
            raise ValueError(f"input {index} has {len(types)} token types for {len(ids)} tokens")
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"input {index} has a token id outside the vocabulary [0, {cfg.vocab_size})")
        if min(types) < 0 or max(types) >= cfg.n_token_types:
            raise ValueError(f"input {index} has a token type outside [0, {cfg.n_token_types})")


def _pooled_rows(cfg: EncoderConfig, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The rows of a step's hidden states each input's pooling reads: all of them for the mean, else one."""
    if cfg.task == "embed" and cfg.pooling == "mean":
        return np.arange(int(starts[-1]), dtype=np.int32)
    return (starts[1:] - 1 if cfg.pooling == "last" else starts[:-1]).astype(np.int32)


class EncoderForward:
    """A BERT encoder's step (decoding.kernels.encoder) over packed inputs; every input's rows pooled."""

    def __init__(self, model: EncoderModel, config: EngineConfig, pool: SpinPool, max_tokens: int) -> None:
        self.model = model
        self.pool = pool
        self.fast = int8_kernels(config.kernels)
        self.max_inputs = max_tokens
        self.weights = EncoderKernelWeights.build(model.config, model.weights, fast=self.fast)
        self.architecture = EncoderArchitecture.of(model.config)
        self.scratch = EncoderScratch.allocate(model.config, max_tokens, pool.n_threads, tile_mode(config.kernels))

    def run(self, inputs: list[EncoderInput], lengths: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
        n = int(starts[-1])
        step = EncoderInputs(
            token_ids=np.fromiter(itertools.chain.from_iterable(ids for ids, _ in inputs), np.int64, n),
            type_ids=np.fromiter(itertools.chain.from_iterable(t for _, t in inputs), np.int64, n),
            positions=np.concatenate([np.arange(length, dtype=np.int64) for length in lengths]),
            token_seq=np.repeat(np.arange(len(inputs), dtype=np.int64), lengths), seq_starts=starts,
        )  # fmt: skip
        w = self.weights
        self.pool.run(encoder_step, self.fast, step, w.matrices, w.packed, w.arrays, self.architecture, self.scratch)
        hidden, cfg, weights = self.scratch.x, self.model.config, self.model.weights
        bounds = zip(starts[:-1], starts[1:], strict=True)
        return [pool_hidden(cfg, weights, hidden[begin:end]) for begin, end in bounds]


class DecoderForward:
    """A generation model's step (decoding.kernels.forward.model_step) over packed prompt-only inputs.

    Each input's keys and values go to blocks of a small cache of its own, laid out afresh every step
    (nothing outlives the step), and only the rows the pooling reads go through the final norm; the
    scratch has no logits columns, so the LM head does no work."""

    def __init__(self, model: DecoderEmbedder, config: EngineConfig, pool: SpinPool, max_tokens: int) -> None:
        self.model = model
        self.pool = pool
        self.fast = int8_kernels(config.kernels)
        decoder = model.decoder
        mc = decoder.config
        self.block_size = config.block_size
        self.max_inputs = min(config.max_num_seqs, max_tokens)  # each input starts a block: they bound the cache
        spec = KVCacheSpec(n_layers=mc.n_layers, n_kv_heads=mc.n_kv_heads, head_dim=mc.head_dim,
                           block_size=self.block_size, dtype=resolve_kv_cache_dtype(config))  # fmt: skip
        self.storage = KVCacheStorage.allocate(spec, -(-max_tokens // self.block_size) + self.max_inputs)
        cache = weight_cache.cache_file(decoder.path) if config.weight_cache and decoder.path.is_file() else None
        self.weights = KernelWeights.build(mc, decoder.weights, fast=self.fast, cache=cache)
        self.architecture = Architecture.of(mc)
        headless = replace(mc, vocab_size=0)
        self.scratch = StepScratch.allocate(headless, max_tokens, max_tokens, pool.n_threads, self.block_size,
                                            tile_mode(config.kernels))

    def run(self, inputs: list[EncoderInput], lengths: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
        n, bs = int(starts[-1]), self.block_size
        blocks = -(-lengths // bs)
        first_block = np.zeros(len(inputs), dtype=np.int64)
        np.cumsum(blocks[:-1], out=first_block[1:])
        tables = np.zeros((len(inputs), int(blocks.max())), dtype=np.int32)
        for row, (first, count) in enumerate(zip(first_block, blocks, strict=True)):
            tables[row, :count] = np.arange(first, first + count)
        positions = np.concatenate([np.arange(length, dtype=np.int32) for length in lengths])
        seq_of_row = np.repeat(np.arange(len(inputs)), lengths)
        cfg = self.model.config
        rows = _pooled_rows(cfg, lengths, starts)
        token_ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in inputs), np.int32, n)
        w = self.weights
        step = StepInputs(
            token_ids=token_ids, embedding_rows=w.token_rows.gather(token_ids), positions=positions,
            slot_mapping=(tables[seq_of_row, positions // bs] * bs + positions % bs).astype(np.int32),
            block_tables=tables, context_lens=lengths.astype(np.int32), query_start_loc=starts.astype(np.int32),
            logit_rows=rows, num_head_rows=0,
        )  # fmt: skip
        w.cover_positions(step.positions)
        self.pool.run(model_step, self.fast, step, w.matrices, w.packed, w.arrays, self.architecture,
                      self.storage.key_cache, self.storage.value_cache, self.scratch)  # fmt: skip
        final = self.scratch.final
        if cfg.pooling == "mean":
            bounds = zip(starts[:-1], starts[1:], strict=True)
            return [pool_hidden(cfg, None, final[begin:end]) for begin, end in bounds]
        score_rows = self.model.score_rows
        return [pool_hidden(cfg, None, final[i : i + 1], score_rows) for i in range(len(inputs))]


class EmbeddingEngine:
    """Serves an EncoderModel: `submit` from any thread; one engine thread runs the steps."""

    def __init__(self, model: EncoderModel | DecoderEmbedder, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = cfg = config or EngineConfig()
        mc = model.config
        self.max_model_len = mc.max_context
        self.max_num_tokens = max(cfg.max_num_batched_tokens, mc.max_context)  # one input always fits a step
        self.pool = SpinPool(cfg.n_threads, pin=cfg.pin_threads)
        self.forward: EncoderForward | DecoderForward = (
            DecoderForward(model, cfg, self.pool, self.max_num_tokens) if isinstance(model, DecoderEmbedder)
            else EncoderForward(model, cfg, self.pool, self.max_num_tokens))  # fmt: skip
        self.stats = EncoderStats()
        self._active: deque[EncodeRequest] = deque()  # engine thread only, with _wakeup held to add
        self._wakeup = threading.Condition()
        self._ids = itertools.count()
        self._stopping = False
        self.failure: str | None = None
        self._thread: threading.Thread | None = None

    # ---- any thread -------------------------------------------------------------------------------

    def start(self) -> EmbeddingEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="treadle-encoder", daemon=True)
            self._thread.start()
        return self

    def validate(self, inputs: list[EncoderInput]) -> None:
        """Raise InputTooLong (naming the input) or ValueError for inputs that could never be computed."""
        validate_inputs(self.model.config, inputs, self.max_model_len)

    def submit(self, inputs: list[EncoderInput],
               request_id: str | None = None) -> concurrent.futures.Future[np.ndarray]:
        """Queue a request; its future gives (len(inputs), output_dim) float32 once every input is done.
        Cancelling the future drops the inputs not yet computed."""
        self.validate(inputs)
        future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        request = EncodeRequest(request_id or f"emb-{next(self._ids)}", list(inputs), future,
                                np.zeros((len(inputs), self.model.config.output_dim), dtype=np.float32))
        with self._wakeup:
            if self.failure is not None:
                raise EngineFailed(f"the engine failed and serves nothing more: {self.failure}")
            if self._stopping:
                raise EngineShuttingDown("the engine is shutting down")
            if len(self._active) >= self.config.max_queue:
                raise QueueFull(f"{len(self._active)} requests are running or waiting (max_queue)")
            if not inputs:
                future.set_result(request.outputs)
                return future
            self._active.append(request)
            self._wakeup.notify()
        return future

    def encode(self, inputs: list[EncoderInput]) -> np.ndarray:
        """Submit and wait (tests, the command line)."""
        return self.submit(inputs).result()

    @property
    def num_unfinished(self) -> int:
        return len(self._active)

    @property
    def is_failed(self) -> bool:
        return self.failure is not None or (self._thread is not None and not self._thread.is_alive()
                                            and not self._stopping)  # fmt: skip

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        self.pool.close()

    # ---- engine thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not self._active and not self._stopping:
                        self._wakeup.wait()
                    if self._stopping:
                        break
                self.step()
        except BaseException as exc:
            log.critical("the encoder thread died: %s: %s", type(exc).__name__, exc)
            with self._wakeup:
                self.failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            with self._wakeup:
                self._stopping = True
                ended, self._active = list(self._active), deque()
            why = EngineFailed(f"the engine failed: {self.failure}") if self.failure else EngineShuttingDown(
                "the engine shut down before the request finished")
            for request in ended:
                request.resolve(why)

    def _schedule(self) -> list[tuple[EncodeRequest, int]]:
        """This step's inputs: (request, input index), one per request in turn, under the token budget."""
        with self._wakeup:
            for request in [r for r in self._active if r.is_cancelled]:
                self._active.remove(request)
            requests = [r for r in self._active if r.next_input < len(r.inputs)]
        chosen: list[tuple[EncodeRequest, int]] = []
        budget = self.max_num_tokens
        turns = deque(requests)
        while turns and len(chosen) < self.forward.max_inputs:  # a turn takes an input or drops a request
            request = turns.popleft()
            length = len(request.inputs[request.next_input][0])
            if length > budget:
                continue  # its next input waits for the next step (the oldest request's first always fits)
            chosen.append((request, request.next_input))
            request.next_input += 1
            budget -= length
            if request.next_input < len(request.inputs):
                turns.append(request)
        return chosen

    def step(self) -> None:
        chosen = self._schedule()
        if not chosen:
            return
        inputs = [request.inputs[i] for request, i in chosen]
        lengths = np.array([len(ids) for ids, _ in inputs], dtype=np.int64)
        starts = np.zeros(len(inputs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        outputs = self.forward.run(inputs, lengths, starts)
        for (request, index), output in zip(chosen, outputs, strict=True):
            request.outputs[index] = output
            request.num_done += 1
        self.stats.num_steps += 1
        self.stats.num_inputs += len(inputs)
        self.stats.num_tokens += int(starts[-1])
        for request in {id(r): r for r, _ in chosen}.values():
            if request.num_done == len(request.inputs):
                with self._wakeup:
                    self._active.remove(request)
                self.stats.num_requests += 1
                request.resolve(request.outputs)
