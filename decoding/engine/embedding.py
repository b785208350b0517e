"""The engine of an encoder model: requests of many inputs, packed into steps, each step one `pool.run`.

    submit(inputs) → the loop packs inputs under the step's token budget → encoder_step on the pool
        → each input's hidden states pooled (or scored) → the request's future once all of its are done

An encoder keeps nothing between steps (no KV: every input is computed whole in one step, its attention
sees all of it), so scheduling is packing. Each step takes inputs from the requests in arrival order,
one input per request in turn, until `max_num_batched_tokens` (an input never spans steps): a request
of 2,000 inputs is spread over many steps and a short request arriving behind it shares the next one
instead of waiting for the whole batch. Requests cancelled (the client left) drop their inputs not yet
computed. The thread parks while there is nothing to do, as the generation engine's does.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from threadpool import SpinPool

from ..kernels.encoder import EncoderArchitecture, EncoderInputs, EncoderKernelWeights, EncoderScratch, encoder_step
from ..model.encoder import EncoderConfig, EncoderModel, EncoderWeights
from .config import EngineConfig
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
    arrival_time: float = field(default_factory=time.monotonic)
    next_input: int = 0  # inputs before it are scheduled
    num_done: int = 0

    @property
    def is_cancelled(self) -> bool:
        return self.future.cancelled()

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.inputs)


@dataclass(slots=True)
class EncoderStats:
    num_steps: int = 0
    num_inputs: int = 0
    num_tokens: int = 0
    num_requests: int = 0


def pool_hidden(cfg: EncoderConfig, weights: EncoderWeights, hidden: np.ndarray) -> np.ndarray:
    """One input's output from its last hidden states (n, dim): the pooled (and normalised) vector of an
    embedder, or a cross-encoder's scores (the [CLS] state through the pooler and classifier)."""
    if cfg.task == "classify":
        pooled = np.tanh(weights.pooler @ hidden[0] + weights.pooler_bias)
        scores = weights.classifier @ pooled + weights.classifier_bias
        return (1.0 / (1.0 + np.exp(-scores)) if cfg.sigmoid else scores).astype(np.float32)
    if cfg.pooling == "cls":
        vector = hidden[0].copy()
    elif cfg.pooling == "last":
        vector = hidden[-1].copy()
    else:
        vector = hidden.mean(axis=0, dtype=np.float32)
    if cfg.normalize:
        vector /= max(float(np.linalg.norm(vector)), 1e-12)  # sentence-transformers' F.normalize eps
    return vector


class EmbeddingEngine:
    """Serves an EncoderModel: `submit` from any thread; one engine thread runs the steps."""

    def __init__(self, model: EncoderModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = cfg = config or EngineConfig()
        mc = model.config
        self.max_model_len = mc.max_context
        self.max_num_tokens = max(cfg.max_num_batched_tokens, mc.max_context)  # one input always fits a step
        self.weights = EncoderKernelWeights.build(mc, model.weights, fast=cfg.kernels == "fast")
        self.pool = SpinPool(cfg.n_threads, pin=cfg.pin_threads)
        self.architecture = EncoderArchitecture.of(mc)
        self.scratch = EncoderScratch.allocate(mc, self.max_num_tokens, self.pool.n_threads)
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
        cfg = self.model.config
        for index, (ids, types) in enumerate(inputs):
            if not ids:
                raise ValueError(f"input {index} is empty")
            if len(ids) > self.max_model_len:
                raise InputTooLong(index, len(ids), self.max_model_len)
            if len(types) != len(ids):
                raise ValueError(f"input {index} has {len(types)} token types for {len(ids)} tokens")
            if min(ids) < 0 or max(ids) >= cfg.vocab_size:
                raise ValueError(f"input {index} has a token id outside the vocabulary [0, {cfg.vocab_size})")
            if min(types) < 0 or max(types) >= cfg.n_token_types:
                raise ValueError(f"input {index} has a token type outside [0, {cfg.n_token_types})")

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
                _resolve(request.future, why)

    def _schedule(self) -> list[tuple[EncodeRequest, int]]:
        """This step's inputs: (request, input index), one per request in turn, under the token budget."""
        with self._wakeup:
            for request in [r for r in self._active if r.is_cancelled]:
                self._active.remove(request)
            requests = [r for r in self._active if r.next_input < len(r.inputs)]
        chosen: list[tuple[EncodeRequest, int]] = []
        budget = self.max_num_tokens
        turns = deque(requests)
        while turns:  # each turn takes one input or drops the request from this step: it ends
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
        step = EncoderInputs(
            token_ids=np.fromiter(itertools.chain.from_iterable(ids for ids, _ in inputs), np.int64, int(starts[-1])),
            type_ids=np.fromiter(itertools.chain.from_iterable(t for _, t in inputs), np.int64, int(starts[-1])),
            positions=np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]),
            token_seq=np.repeat(np.arange(len(inputs), dtype=np.int64), lengths), seq_starts=starts,
        )  # fmt: skip
        w = self.weights
        self.pool.run(encoder_step, self.config.kernels == "fast", step, w.matrices, w.packed, w.arrays,
                      self.architecture, self.scratch)  # fmt: skip
        hidden = self.scratch.x
        cfg, weights = self.model.config, self.model.weights
        for (request, index), begin, end in zip(chosen, starts[:-1], starts[1:], strict=True):
            request.outputs[index] = pool_hidden(cfg, weights, hidden[begin:end])
            request.num_done += 1
        self.stats.num_steps += 1
        self.stats.num_inputs += len(inputs)
        self.stats.num_tokens += int(starts[-1])
        for request in {id(r): r for r, _ in chosen}.values():
            if request.num_done == len(request.inputs):
                with self._wakeup:
                    self._active.remove(request)
                self.stats.num_requests += 1
                _resolve(request.future, request.outputs)


def _resolve(future: concurrent.futures.Future[np.ndarray], outcome: np.ndarray | BaseException) -> None:
    """Set a request's result or exception unless its client cancelled it meanwhile."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled between the check and now: nobody is waiting
