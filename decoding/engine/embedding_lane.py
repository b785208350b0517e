"""Embedding inputs inside the generation engine's steps (`treadle serve --task generate,embed`).

    Engine.submit_embedding → EmbeddingLane.add → each step, Scheduler.schedule asks the lane for chunks
        → their rows run in the same model step as the generation's → finish() pools the final-normed rows

An input is a prompt whose keys and values nobody decodes from: it takes blocks of the KV cache when it
starts and frees them once its last chunk ran. The lane fills what remains of the step's prompt budget
after the decodes, the prefills and the admissions (`PrefillBudget`, so the step-time bound that holds
prompts while streams decode holds the inputs too), inputs under way first, then new ones one per request
in turn, as the embedding engine packs them: a request of 2,000 inputs is spread over many steps and
neither a stream nor a short request behind it waits for all of it. An input longer than what a step
leaves is split over steps like a prompt; the mean pooling sums its rows as they come. Last-token
pooling reads only the last row, so an input may start from a prefix the cache holds (an instruction
shared by every query); mean and first-token pooling compute every row.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvcache.manager import KVCacheManager

from ..model.decoder_embedder import DecoderEmbedder
from .config import EngineConfig
from .embedding import EncodeRequest, EncoderInput, finish_pooled, validate_inputs
from .step_costs import PrefillBudget

# sequence ids of the lane's inputs: apart from the generation's (which count up from 1)
_input_seq_ids = itertools.count(-1, -1)


@dataclass(eq=False, slots=True)
class InputInProgress:
    request: EncodeRequest
    index: int  # of the input in its request
    seq_id: int  # its blocks in the KV cache
    num_computed: int = 0
    pooled: np.ndarray | None = None  # float64 sum of the rows pooled so far (the mean), or the row itself

    @property
    def token_ids(self) -> list[int]:
        return self.request.inputs[self.index][0]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass(slots=True)
class EmbeddingChunk:
    """Tokens of one input a step computes, and which of its rows the pooling reads."""

    input: InputInProgress
    position: int  # of its first token in the input
    token_ids: list[int]
    pooled_rows: list[int] = field(default_factory=list)  # offsets in the chunk

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_last(self) -> bool:
        return self.position + self.num_tokens == len(self.input.token_ids)


class EmbeddingLane:
    """The embedding requests of a generation engine; engine thread only (the engine's inbox adds)."""

    def __init__(self, kv: KVCacheManager, embedder: DecoderEmbedder, max_inputs: int,
                 on_request_done: Callable[[EncodeRequest], None]) -> None:  # fmt: skip
        self.kv = kv
        self.config = embedder.config
        self.score_rows = embedder.score_rows  # a reranker's
        self.max_inputs = max_inputs  # inputs under way at once (each holds blocks until its last chunk)
        self.requests: deque[EncodeRequest] = deque()
        self.in_progress: list[InputInProgress] = []
        self._on_request_done = on_request_done

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def add(self, request: EncodeRequest) -> None:
        self.requests.append(request)

    def schedule(self, budget: PrefillBudget, start_inputs: bool = True) -> list[EmbeddingChunk]:
        """This step's chunks, within what `budget` has left (taken from it): the inputs under way, then
        new ones unless `start_inputs` is False (the step preempted a sequence for blocks)."""
        self._drop_cancelled()
        chunks: list[EmbeddingChunk] = []
        for item in self.in_progress:
            chunk = self._chunk(item, budget)
            if chunk is not None:
                chunks.append(chunk)
        turns = deque(r for r in self.requests if r.next_input < len(r.inputs)) if start_inputs else deque()
        while turns and budget.tokens and len(self.in_progress) < self.max_inputs:
            request = turns.popleft()
            token_ids = request.inputs[request.next_input][0]
            if budget.share(len(token_ids), len(token_ids)) == 0:
                break
            use_cache = self.config.pooling == "last"  # the other poolings read every row
            if not self.kv.can_allocate(token_ids, use_cache):
                break  # blocks free up as inputs and sequences finish
            started = InputInProgress(request, request.next_input, next(_input_seq_ids))
            started.num_computed = self.kv.allocate(started.seq_id, token_ids, use_cache)
            request.next_input += 1
            self.in_progress.append(started)
            chunk = self._chunk(started, budget)
            if chunk is not None:
                chunks.append(chunk)
            if request.next_input < len(request.inputs):
                turns.append(request)
        return chunks

    def _chunk(self, item: InputInProgress, budget: PrefillBudget) -> EmbeddingChunk | None:
        num_tokens = budget.take(item.num_uncomputed, len(item.token_ids))
        if num_tokens == 0:
            return None
        begin = item.num_computed
        token_ids = item.token_ids[begin : begin + num_tokens]
        self.kv.append_slots(item.seq_id, token_ids)  # an input's blocks are its own: no copies
        chunk = EmbeddingChunk(item, begin, token_ids)
        pooling = self.config.pooling
        if pooling == "mean":
            chunk.pooled_rows = list(range(num_tokens))
        elif pooling == "last" and chunk.is_last:
            chunk.pooled_rows = [num_tokens - 1]
        elif pooling == "cls" and begin == 0:
            chunk.pooled_rows = [0]
        return chunk

    def finish(self, chunks: list[EmbeddingChunk], pooled: np.ndarray) -> None:
        """After the step ran: `pooled` holds the chunks' pooled rows in order; inputs whose last chunk ran
        are pooled and free their blocks, requests whose inputs are all done get their result."""
        row = 0
        for chunk in chunks:
            item = chunk.input
            rows = pooled[row : row + len(chunk.pooled_rows)]
            row += len(chunk.pooled_rows)
            if len(rows):
                total = rows.sum(axis=0, dtype=np.float64)
                item.pooled = total if item.pooled is None else item.pooled + total
            item.num_computed += chunk.num_tokens
            if not chunk.is_last:
                continue
            self.in_progress.remove(item)
            self.kv.free(item.seq_id)
            request = item.request
            assert item.pooled is not None, "every pooling reads a row of the input's first or last chunk"
            count = len(item.token_ids) if self.config.pooling == "mean" else 1
            request.outputs[item.index] = finish_pooled(self.config, item.pooled / count, self.score_rows)
            request.num_done += 1
            if request.num_done == len(request.inputs) and request in self.requests:
                self.requests.remove(request)
                self._on_request_done(request)
                request.resolve(request.outputs)

    def abandon(self, chunks: list[EmbeddingChunk], error: BaseException) -> None:
        """The step holding these chunks failed: their requests end with `error`, their inputs' KV (never
        written) is freed unpublished."""
        for request in {id(c.input.request): c.input.request for c in chunks}.values():
            self._end(request, error)

    def end_all(self, error: BaseException) -> None:
        """End every request (shutdown, or a failure whose scope is unknown)."""
        for request in list(self.requests):
            self._end(request, error)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.requests if r.is_cancelled]:
            self._end(request, None)

    def _end(self, request: EncodeRequest, error: BaseException | None) -> None:
        for item in [i for i in self.in_progress if i.request is request]:
            self.in_progress.remove(item)
            self.kv.free(item.seq_id, latest_step_ran=False)
        if request in self.requests:
            self.requests.remove(request)
            self._on_request_done(request)
        if error is not None:
            request.resolve(error)


class GenerationEngine(Protocol):
    """What SharedEmbeddingEngine reads of decoding.engine.engine.Engine."""

    config: EngineConfig
    kv: KVCacheManager
    failure: str | None

    def submit_embedding(self, request: EncodeRequest) -> None: ...
    def start(self) -> GenerationEngine: ...
    def shutdown(self) -> None: ...
    @property
    def num_unfinished(self) -> int: ...
    @property
    def is_failed(self) -> bool: ...


class SharedEmbeddingEngine:
    """The embedding engine's interface (`submit`, `encode`, ...) over a generation engine whose steps
    carry the inputs (Engine.serve_embeddings): what the retrieval routes call on a server that does both."""

    def __init__(self, engine: GenerationEngine, model: DecoderEmbedder, max_model_len: int) -> None:
        self.engine = engine
        self.model = model
        self.max_model_len = max_model_len
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def validate(self, inputs: list[EncoderInput]) -> None:
        validate_inputs(self.model.config, inputs, self.max_model_len)
        for ids, _ in inputs:
            self.engine.kv.check_fits(len(ids))  # raises if the KV cache could never hold it

    def submit(self, inputs: list[EncoderInput],
               request_id: str | None = None) -> concurrent.futures.Future[np.ndarray]:
        """As EmbeddingEngine.submit: (len(inputs), output_dim) float32 once every input is done."""
        self.validate(inputs)
        future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        request = EncodeRequest(request_id or f"emb-{next(self._ids)}", list(inputs), future,
                                np.zeros((len(inputs), self.model.config.output_dim), dtype=np.float32))
        if not inputs:
            future.set_result(request.outputs)
            return future
        self.engine.submit_embedding(request)
        return future

    def encode(self, inputs: list[EncoderInput]) -> np.ndarray:
        return self.submit(inputs).result()

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished

    @property
    def is_failed(self) -> bool:
        return self.engine.is_failed

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    def start(self) -> SharedEmbeddingEngine:
        self.engine.start()
        return self

    def shutdown(self) -> None:
        self.engine.shutdown()
