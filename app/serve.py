"""`treadle serve`: the OpenAI-compatible API over HTTP (uvicorn).

    treadle serve --port 8000
    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'

The model loads before the port opens (a bad --model exits with status 2); the engine then warms up
in the background (kernels compile on a first start) while /health answers 503, then 200.

SIGTERM or Ctrl-C drains: new generation requests get 503 while those in flight run on for up to
--shutdown-grace-seconds; what is left then ends with an error event; the process exits 0. A second
signal ends the grace period at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator

import uvicorn

from decoding import ModelLoadError
from decoding.engine.embedding import EmbeddingEngine
from decoding.engine.engine import Engine
from decoding.model.decoder_embedder import DecoderEmbedder
from decoding.model.encoder import EncoderModel

from .application import build_app, build_encoder_app
from .embedding_routes import EncoderServing
from .faults import install_from_env
from .model_loading import embedder_of, load_served_model
from .server import ServingState
from .settings import ServerSettings, parse_serve_args

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESPONSE_FLUSH_SECONDS = 5  # after the drain: for responses to write their last events


class DrainingServer(uvicorn.Server):
    """uvicorn's server with our own signal handling. uvicorn's stops admitting by closing the
    listener at once, cuts SSE streams (through sse-starlette's hook) and re-raises the signal when
    done, so the process dies with status 143. Here a signal drains first (ServingState.drain),
    then stops the server, and `run()` returns normally."""

    def __init__(self, config: uvicorn.Config, state: ServingState | EncoderServing, grace_seconds: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_seconds = grace_seconds
        self._drain: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in SHUTDOWN_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in SHUTDOWN_SIGNALS:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log = logging.getLogger("treadle")
        if self._drain is None:
            log.info("%s: shutting down gracefully (a second signal ends the grace period)", sig.name)
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())
        elif not self.should_exit:
            log.info("%s again: ending the requests in flight now", sig.name)
            self.state.hurry()
        else:
            self.force_exit = True  # uvicorn is already closing: stop waiting for connections

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.grace_seconds)
        finally:
            self.should_exit = True


def _configure_logging(settings: ServerSettings) -> None:
    level = logging.DEBUG if settings.log_level == "trace" else getattr(logging, settings.log_level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("treadle: %(message)s"))
    for name in ("treadle", "app", "decoding", "kvcache", "threadpool"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.addHandler(handler)
        logger.propagate = False


def _exit_now(sig: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    settings, ray = parse_serve_args(argv)
    if ray is not None:  # replicas behind Ray Serve (the `ray` extra, imported only then; docs/scaling.md)
        from .ray.deployment import main as ray_main

        return ray_main(settings, ray)
    _configure_logging(settings)
    for sig in SHUTDOWN_SIGNALS:  # until the server listens nothing is in flight: a signal just ends it
        signal.signal(sig, _exit_now)
    log = logging.getLogger("treadle")
    log.info("loading %s ...", settings.model)
    started = time.perf_counter()
    try:
        model = load_served_model(settings)
        engine: Engine | EmbeddingEngine = (
            EmbeddingEngine(model, settings.engine) if isinstance(model, EncoderModel | DecoderEmbedder)
            else Engine(model, settings.engine))  # fmt: skip
        embeddings = (engine.serve_embeddings(embedder_of(engine.model, settings))
                      if isinstance(engine, Engine) and settings.task == "generate,embed" else None)  # fmt: skip
    except ModelLoadError as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, MemoryError) as exc:  # an engine setting that cannot work (cache too small, ...)
        print(f"treadle: error: cannot build the engine: {exc}", file=sys.stderr)
        return 2
    log.info("loaded in %.1f s; listening on http://%s:%d (/health is 503 until warm)",
             time.perf_counter() - started, settings.host, settings.port)

    startup_failed = False

    def stop_after_failed_startup() -> None:
        nonlocal startup_failed
        startup_failed = True
        server.should_exit = True

    if isinstance(engine, EmbeddingEngine):
        app = build_encoder_app(settings, engine, on_startup_failure=stop_after_failed_startup)
    else:
        try:
            faults = install_from_env(engine)
        except ValueError as exc:
            print(f"treadle: error: {exc}", file=sys.stderr)
            engine.shutdown()
            return 2
        if faults is not None:
            log.warning("TEST FAULT INJECTION IS ON: engine steps fail %s", faults.describe())
        app = build_app(settings, engine, on_startup_failure=stop_after_failed_startup, embeddings=embeddings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=RESPONSE_FLUSH_SECONDS)
    server = DrainingServer(config, app.state.serving, settings.shutdown_grace_seconds)
    try:
        server.run()
    finally:
        engine.shutdown()
    if startup_failed:
        return 1
    return 0 if server.started else 1
