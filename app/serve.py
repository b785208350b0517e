"""`treadle serve`: the OpenAI-compatible API over HTTP (uvicorn).

    treadle serve --port 8000
    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'

The model loads before the port opens (a bad --model exits with status 2); the engine then warms up
in the background (kernels compile on a first start) while /health answers 503, then 200.
"""

from __future__ import annotations

import logging
import sys
import time

import uvicorn

from decoding import ModelLoadError, load_model
from decoding.engine import Engine

from .server import build_app
from .settings import ServerSettings, parse_settings


def _configure_logging(settings: ServerSettings) -> None:
    level = logging.DEBUG if settings.log_level == "trace" else getattr(logging, settings.log_level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("treadle: %(message)s"))
    for name in ("treadle", "app", "decoding"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.addHandler(handler)
        logger.propagate = False


def main(argv: list[str]) -> int:
    settings = parse_settings(argv)
    _configure_logging(settings)
    log = logging.getLogger("treadle")
    log.info("loading %s ...", settings.model)
    started = time.perf_counter()
    try:
        engine = Engine(load_model(settings.model), settings.engine_config())
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

    app = build_app(settings, engine, on_startup_failure=stop_after_failed_startup)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        engine.shutdown()
    if startup_failed:
        return 1
    return 0 if server.started else 1
