"""The retrieval half: an encoder model's server (`treadle serve --model all-minilm-l6-v2`) and its routes.

    POST /v1/embeddings        OpenAI's embeddings (float or base64; `dimensions` for Matryoshka models)
    POST /v1/rerank, /rerank   the rerank shape of Jina and Cohere that llama-server and vLLM answer
    POST /v1/score, /score     vLLM's score: one text against many, or pairwise
    POST /api/embed            Ollama's embed (and its older /api/embeddings)
    GET  /v1/models, /health, /metrics; POST /tokenize

A cross-encoder scores each (query, document) pair in one input; an embedder scores by the cosine of
the two texts' embeddings, as vLLM does. The generation routes answer 400 saying what this server serves,
as a generation server's retrieval routes do (`GENERATION_ONLY_ROUTES`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from decoding.engine.embedding import EmbeddingEngine, EncoderInput, InputTooLong
from decoding.engine.embedding_lane import SharedEmbeddingEngine
from decoding.engine.errors import EngineFailed, EngineShuttingDown, QueueFull

from . import routes
from .body import read_body
from .embedding_protocol import (
    EmbeddingsRequest,
    InputPreparer,
    OllamaEmbedRequest,
    OllamaLegacyEmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    cut_dimensions,
    embedding_data,
    new_id,
    now,
)
from .errors import APIError, encoded_response
from .metrics import ServerMetrics
from .schema_base import StrictBody
from .server import Serving, ServingState, serving
from .settings import ServerSettings

log = logging.getLogger("treadle")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EncoderMetrics:
    """The retrieval routes' metrics: a registry of their own on an embedding server; beside a generation
    server's (`--task generate,embed`), in its registry under names of their own."""

    def __init__(self, engine: EmbeddingEngine | SharedEmbeddingEngine, beside: ServerMetrics | None = None) -> None:
        self.registry = registry = CollectorRegistry() if beside is None else beside.registry
        self.requests = Counter("treadle_embedding_requests", "Retrieval requests answered, by route.", ["route"],
                                registry=registry)
        self.inputs = Counter("treadle_embedding_inputs", "Inputs encoded (texts, or query-document pairs).",
                              registry=registry)
        if beside is not None:
            self.prompt_tokens = Counter("treadle_embedding_prompt_tokens", "Tokens of the inputs encoded.",
                                         registry=registry)
            self.requests_rejected = beside.requests_rejected
            self.latency = Histogram("treadle_embedding_request_latency_seconds", "Arrival to answer.",
                                     buckets=_LATENCY_BUCKETS, registry=registry)
            return
        self.prompt_tokens = Counter("treadle_prompt_tokens", "Tokens of the inputs encoded.", registry=registry)
        self.requests_rejected = Counter("treadle_requests_rejected", "Requests refused with 429 (queue full).",
                                         registry=registry)
        self.latency = Histogram("treadle_e2e_request_latency_seconds", "Arrival to answer.",
                                 buckets=_LATENCY_BUCKETS, registry=registry)
        Gauge("treadle_num_requests_running", "Requests with inputs in the engine.",
              registry=registry).set_function(lambda: engine.num_unfinished)

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EncoderServing(Serving):
    """What the retrieval routes need: an embedding engine (once warm) and the input preparer, beside the
    admission and draining every server has (app.server.Serving)."""

    def __init__(self, settings: ServerSettings, engine: EmbeddingEngine | SharedEmbeddingEngine,
                 on_startup_failure: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.model = engine.model
        self._init_serving(engine.model.name, on_startup_failure)
        cfg = engine.model.config
        self.inputs = InputPreparer(engine.model.tokenizer, engine.max_model_len, cfg.vocab_size)
        self.metrics = EncoderMetrics(engine)

    def warm_up(self) -> None:
        """Start the engine and encode one input, so numba compiles before /health says ready."""
        try:
            started = time.perf_counter()
            log.info("warming up %s (the first start compiles kernels) ...", self.model_name)
            self.engine.start()
            self.engine.encode([self.engine.model.tokenizer.encode("warm up")])
            self.is_ready = True
            log.info("ready in %.1f s: %s, a %s encoder (%s), max_queue %d", time.perf_counter() - started,
                     self.model_name, self.model.config.architecture, self.model.config.task,
                     self.settings.max_queue)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - whatever stops the warm-up, report it and stop serving
            self._startup_failed(exc)

    def check_task(self, task: str, route: str) -> None:
        if self.model.config.task != task:
            does = "embeds texts" if self.model.config.task == "embed" else "scores text pairs (a cross-encoder)"
            raise APIError(400, f"{route} needs an embedding model; {self.model_name} {does}: use /v1/rerank or "
                                "/v1/score", code="unsupported_model")  # fmt: skip

    async def encode(self, request: Request, inputs: list[EncoderInput]) -> np.ndarray:
        """Submit and wait; the client leaving cancels what is not yet computed."""
        try:
            future = self.engine.submit(inputs)
        except QueueFull:
            raise self.queue_full() from None
        except InputTooLong as exc:
            raise APIError(400, str(exc), f"input[{exc.index}]", code="context_length_exceeded") from None
        except (EngineShuttingDown, EngineFailed) as exc:
            raise APIError(503, str(exc), code="unavailable") from None
        waiter = asyncio.wrap_future(future)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if waiter not in done:
                future.cancel()
                raise APIError(499, "the client disconnected", code="client_disconnected")
            try:
                result = waiter.result()
            except (EngineShuttingDown, EngineFailed) as exc:
                raise APIError(503, str(exc), code="unavailable") from None
        finally:
            watcher.cancel()
        self.metrics.inputs.inc(len(inputs))
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in inputs))
        return result


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (a plain request has no other way to know)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class RetrievalBesideGeneration(EncoderServing):
    """The retrieval routes on a generation server (`--task generate,embed`): the inputs go through the
    generation engine's steps (SharedEmbeddingEngine); readiness, draining, names and the queue bound are
    the generation server's."""

    def __init__(self, generation: ServingState, engine: SharedEmbeddingEngine) -> None:
        self.settings = generation.settings
        self.engine = engine
        self.model = engine.model
        self.generation = generation
        self.served_model_names, self.model_name = generation.served_model_names, generation.model_name
        self.num_preparing = 0
        self.inputs = InputPreparer(engine.model.tokenizer, engine.max_model_len, engine.model.config.vocab_size)
        self.metrics = EncoderMetrics(engine, beside=generation.metrics)

    @property  # type: ignore[override]
    def is_ready(self) -> bool:
        return self.generation.is_ready

    @property  # type: ignore[override]
    def is_draining(self) -> bool:
        return self.generation.is_draining

    @property  # type: ignore[override]
    def startup_error(self) -> str | None:
        return self.generation.startup_error


def encoder_serving(request: Request) -> EncoderServing:
    state: EncoderServing = request.app.state.retrieval
    return state


def _usage(inputs: list[EncoderInput]) -> dict[str, int]:
    tokens = sum(len(ids) for ids, _ in inputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def embeddings(request: Request) -> Response:
    state = encoder_serving(request)
    started = time.perf_counter()
    with state.admission():
        body = await read_body(request, EmbeddingsRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        state.check_task("embed", "/v1/embeddings")
        inputs = await anyio.to_thread.run_sync(_embedding_inputs, state, body)
        vectors = await state.encode(request, inputs)
    cfg = state.model.config
    vectors = cut_dimensions(vectors, body.dimensions, cfg.matryoshka_dims, cfg.normalize)
    state.metrics.requests.labels("/v1/embeddings").inc()
    state.metrics.latency.observe(time.perf_counter() - started)
    return encoded_response(request, {"object": "list", "data": embedding_data(vectors, body.encoding_format),
                                      "model": state.model_name, "usage": _usage(inputs)})


def _embedding_inputs(state: EncoderServing, body: EmbeddingsRequest) -> list[EncoderInput]:
    cfg = state.model.config
    if body.dimensions is not None and body.dimensions != cfg.output_dim:
        cut_dimensions(np.zeros((1, cfg.output_dim), np.float32), body.dimensions, cfg.matryoshka_dims, False)
    limit = state.inputs.limit(body.truncate_prompt_tokens)
    value = body.input
    if isinstance(value, str):
        return state.inputs.texts([value], limit)
    if isinstance(value[0], str):
        return state.inputs.texts(list(value), limit)  # type: ignore[arg-type]
    if isinstance(value[0], int):
        return state.inputs.token_ids([list(value)], limit)  # type: ignore[arg-type]
    return state.inputs.token_ids([list(ids) for ids in value], limit)  # type: ignore[union-attr]


async def _scores(state: EncoderServing, request: Request, pairs: list[tuple[str, str]], limit: int | None,
                  param: str) -> tuple[np.ndarray, list[EncoderInput]]:  # fmt: skip
    """One score per (first, second) pair: a cross-encoder's first label, or the cosine of embeddings."""
    if state.model.config.task == "classify":
        inputs = await anyio.to_thread.run_sync(state.inputs.pairs, pairs, limit, param)
        return (await state.encode(request, inputs))[:, 0], inputs
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))  # each distinct text once
    inputs = await anyio.to_thread.run_sync(state.inputs.texts, texts, limit, param)
    vectors = await state.encode(request, inputs)
    if not state.model.config.normalize:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {text: i for i, text in enumerate(texts)}
    return np.array([float(vectors[row[a]] @ vectors[row[b]]) for a, b in pairs], dtype=np.float32), inputs


async def rerank(request: Request) -> Response:
    state = encoder_serving(request)
    started = time.perf_counter()
    with state.admission():
        body = await read_body(request, RerankRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        documents = body.texts()
        scores, inputs = await _scores(state, request, [(body.query, d) for d in documents],
                                       state.inputs.limit(body.truncate_prompt_tokens), "documents")
    order = sorted(range(len(documents)), key=lambda i: (-float(scores[i]), i))[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    state.metrics.requests.labels("/v1/rerank").inc()
    state.metrics.latency.observe(time.perf_counter() - started)
    tokens = _usage(inputs)["total_tokens"]
    return encoded_response(request, {"id": new_id("rerank"), "model": state.model_name, "results": results,
                                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def score(request: Request) -> Response:
    state = encoder_serving(request)
    started = time.perf_counter()
    with state.admission():
        body = await read_body(request, ScoreRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        scores, inputs = await _scores(state, request, body.pairs(),
                                       state.inputs.limit(body.truncate_prompt_tokens), "text_2")
    state.metrics.requests.labels("/v1/score").inc()
    state.metrics.latency.observe(time.perf_counter() - started)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return encoded_response(request, {"id": new_id("score"), "object": "list", "created": now(),
                                      "model": state.model_name, "data": data, "usage": _usage(inputs)})


async def ollama_embed(request: Request) -> Response:
    state = encoder_serving(request)
    started = time.perf_counter()
    with state.admission():
        body = await read_body(request, OllamaEmbedRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        state.check_task("embed", "/api/embed")
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        limit = state.engine.max_model_len if body.truncate else None
        inputs = await anyio.to_thread.run_sync(state.inputs.texts, texts, limit, "input")
        vectors = await state.encode(request, inputs)
    cfg = state.model.config
    vectors = cut_dimensions(vectors, body.dimensions, cfg.matryoshka_dims, cfg.normalize)
    elapsed = time.perf_counter() - started
    state.metrics.requests.labels("/api/embed").inc()
    state.metrics.latency.observe(elapsed)
    return JSONResponse({"model": state.model_name, "embeddings": vectors.tolist(),
                         "total_duration": int(elapsed * 1e9), "load_duration": 0,
                         "prompt_eval_count": _usage(inputs)["prompt_tokens"]})


async def ollama_embeddings(request: Request) -> Response:
    """Ollama's older /api/embeddings: one `prompt`, one `embedding` (an empty prompt, an empty one)."""
    state = encoder_serving(request)
    with state.admission():
        body = await read_body(request, OllamaLegacyEmbeddingRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        state.check_task("embed", "/api/embeddings")
        if not body.prompt:
            return JSONResponse({"embedding": []})
        inputs = await anyio.to_thread.run_sync(state.inputs.texts, [body.prompt], state.engine.max_model_len)
        vectors = await state.encode(request, inputs)
    state.metrics.requests.labels("/api/embeddings").inc()
    return JSONResponse({"embedding": vectors[0].tolist()})


class TokenizeText(StrictBody):
    model: str | None = None
    prompt: str


async def tokenize(request: Request) -> Response:
    state = encoder_serving(request)
    body = await read_body(request, TokenizeText, state.settings.max_body_bytes)
    state.check_model(body.model)
    ids, _ = await anyio.to_thread.run_sync(state.model.tokenizer.encode, body.prompt)
    return encoded_response(request, {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len})


async def generation_refused(request: Request) -> Response:
    state = encoder_serving(request)
    does = "embeds texts" if state.model.config.task == "embed" else "scores text pairs (a cross-encoder)"
    raise APIError(400, f"this server runs {state.model_name}, which {does}: it answers /v1/embeddings, "
                        "/v1/rerank and /v1/score and generates no text (serve a generation model for "
                        f"{request.url.path})", code="unsupported_model")  # fmt: skip


async def retrieval_refused(request: Request) -> Response:
    """On a generation server: the retrieval routes say what it serves instead."""
    state = serving(request)
    raise APIError(400, f"this server runs the generation model {state.model_name}: it serves no embeddings, "
                        f"reranking or scores (for {request.url.path}, start it with `--task generate,embed`, or "
                        "serve an embedding model: `treadle serve --model all-minilm-l6-v2`)",
                   code="unsupported_model")  # fmt: skip


RETRIEVAL_PATHS = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/api/embed",
                   "/api/embeddings")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat",
                    "/api/generate")
# mounted on a generation server: what an encoder's server would answer, refused there with the reason
GENERATION_ONLY_ROUTES = [Route(path, retrieval_refused, methods=["POST"]) for path in RETRIEVAL_PATHS]

RETRIEVAL_ROUTES = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    *(Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
    *(Route(path, score, methods=["POST"]) for path in ("/v1/score", "/score")),
    Route("/api/embed", ollama_embed, methods=["POST"]),
    Route("/api/embeddings", ollama_embeddings, methods=["POST"]),
]

ENCODER_ROUTES = [
    *RETRIEVAL_ROUTES,
    Route("/tokenize", tokenize, methods=["POST"]),
    # the generation server's own: they read only what every server's state has (app.server.Serving)
    Route("/v1/models", routes.models, methods=["GET"]),
    Route("/health", routes.health, methods=["GET"]),
    Route("/metrics", routes.metrics, methods=["GET"]),
    *(Route(path, generation_refused, methods=["POST"]) for path in GENERATION_PATHS),
]
