"""The starlette application: the routes, CORS and API-key middleware, and a lifespan that warms the
engine up once the server listens."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute

from decoding.engine.embedding import EmbeddingEngine
from decoding.engine.embedding_lane import SharedEmbeddingEngine
from decoding.engine.engine import Engine

from .anthropic_routes import ANTHROPIC_ROUTES
from .embedding_routes import (
    ENCODER_ROUTES,
    GENERATION_ONLY_ROUTES,
    RETRIEVAL_ROUTES,
    EncoderServing,
    RetrievalBesideGeneration,
)
from .errors import EXCEPTION_HANDLERS
from .ollama_routes import OLLAMA_ROUTES
from .responses_routes import RESPONSES_ROUTES
from .routes import CHAT_PAGE_ROUTE, ROUTES
from .server import APIKeyMiddleware, ServingState
from .settings import ServerSettings


def build_app(settings: ServerSettings, engine: Engine, on_startup_failure: Callable[[], None] | None = None,
              embeddings: SharedEmbeddingEngine | None = None) -> Starlette:
    """The ASGI app over an engine that the caller owns (and shuts down after the server stops); with
    `embeddings` (Engine.serve_embeddings), the retrieval routes too.

    The engine is warmed up in the background once the server listens; until then /health is 503.
    """
    state = ServingState(settings, engine, on_startup_failure)
    retrieval = RETRIEVAL_ROUTES if embeddings is not None else GENERATION_ONLY_ROUTES
    routes = [*ROUTES, *RESPONSES_ROUTES, *ANTHROPIC_ROUTES, *OLLAMA_ROUTES, *retrieval,
              *([CHAT_PAGE_ROUTE] if settings.chat_page else [])]
    app = _serving_app(routes, state)
    if embeddings is not None:
        app.state.retrieval = RetrievalBesideGeneration(state, embeddings)
    return app


def build_encoder_app(settings: ServerSettings, engine: EmbeddingEngine,
                      on_startup_failure: Callable[[], None] | None = None) -> Starlette:
    """The app over an embedding model's engine (app/embedding_routes.py), warmed up the same way."""
    state = EncoderServing(settings, engine, on_startup_failure)
    app = _serving_app(ENCODER_ROUTES, state)
    app.state.retrieval = state
    return app


def _serving_app(routes: list[BaseRoute], state: ServingState | EncoderServing) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=state.warm_up, name="treadle-warm-up", daemon=True).start()
        yield

    settings = state.settings
    middleware = []
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                                     expose_headers=["Retry-After"]))
    if settings.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=settings.api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.serving = state
    return app
