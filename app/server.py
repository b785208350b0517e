"""Serving state shared by the routes: the engine, admission control, warm-up, draining; and API-key auth."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import hmac
import importlib.metadata
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from llvmlite import binding
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from decoding.engine.engine import Engine, resolve_kv_cache_dtype
from decoding.engine.params import SamplingParams

from .errors import RETRY_AFTER_SECONDS, APIError, encoded_response, error_for_path
from .metrics import ServerMetrics
from .protocol import TokenText
from .reasoning import resolve
from .response_store import ResponseStore
from .runs import RunRegistry
from .settings import ServerSettings
from .streaming import StreamSettings

log = logging.getLogger("treadle")

# Greedy, then sampled with every option, so the first clients' requests meet no first-use costs.
WARM_UP_PARAMS = (
    SamplingParams(max_tokens=2, temperature=0),
    SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, top_k=8, min_p=0.01, repetition_penalty=1.1,
                   presence_penalty=0.1, seed=0, n=2, logprobs=1),
)


def kernel_target() -> str:
    """The CPU numba compiles the kernels for (the host's name and instruction sets): vector widths and
    fused multiply-adds decide the order and rounding of float operations, so logits, and with them a
    seeded draw or a near-tie under greedy, can differ between targets."""
    return f"{binding.get_host_cpu_name()}:{binding.get_host_cpu_features().flatten()}"


def system_fingerprint(engine: Engine) -> str:
    """OpenAI's `system_fingerprint`: `fp_treadle_` and a hash of what decides the numbers — the model,
    treadle's version, the kernels, the KV cache's type and the CPU the kernels were compiled for. It
    changes when one of them does, so a client can tell why a seeded request stopped repeating itself;
    served names (aliases) leave it as is."""
    try:
        version = importlib.metadata.version("treadle")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = "unknown"
    config = engine.config
    identity = f"{engine.model.name}|{version}|{config.kernels}|{resolve_kv_cache_dtype(config)}|{kernel_target()}"
    return "fp_treadle_" + hashlib.sha256(identity.encode()).hexdigest()[:10]


class Serving:
    """What both kinds of server share: admission control, draining and the served names. A subclass
    sets `settings`, `engine` (a generation or an embedding engine), `metrics` (with `requests_rejected`)
    and calls `_init_serving` for the rest."""

    settings: ServerSettings
    engine: Any
    metrics: Any

    def _init_serving(self, model_name: str, on_startup_failure: Callable[[], None] | None) -> None:
        # --served-model-name: the names a request may give; the first is the one responses report
        self.served_model_names = self.settings.served_model_name or (model_name,)
        self.model_name = self.served_model_names[0]
        self.created = int(time.time())
        self.is_ready = False
        self.startup_error: str | None = None
        self.num_preparing = 0  # requests admitted and being parsed/tokenized, not yet in the engine
        self.is_draining = False  # shutting down: admit nothing new, let requests in flight finish
        self._is_hurried = False  # a second signal: end what is in flight now
        self._on_startup_failure = on_startup_failure

    def _startup_failed(self, exc: Exception) -> None:
        self.startup_error = f"{type(exc).__name__}: {exc}"
        log.error("warm-up failed: %s", self.startup_error)
        if self._on_startup_failure is not None:
            self._on_startup_failure()

    @contextlib.contextmanager
    def admission(self) -> Iterator[Any]:
        """Admit a request or refuse it with 429 — before its body is parsed or its prompt tokenized.

        The bound counts requests in the engine and requests being prepared for it, so nothing queues
        without limit (a bounded queue that rejects, rather than one that grows until latency collapses).
        """
        if self.is_draining:
            # `Connection: close` sends a keep-alive client (or a balancer) to reconnect, elsewhere.
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                           headers={"Retry-After": RETRY_AFTER_SECONDS, "Connection": "close"})
        if self.engine.is_failed:
            raise APIError(503, f"the engine failed and serves nothing more: {self.engine.failure}",
                           code="engine_failed")
        if not self.is_ready:
            raise APIError(503, "the model is still loading" if self.startup_error is None else "startup failed",
                           code="not_ready", headers={"Retry-After": RETRY_AFTER_SECONDS})
        if self.engine.num_unfinished + self.num_preparing >= self.settings.max_queue:
            raise self.queue_full()
        self.num_preparing += 1
        try:
            yield self.engine
        finally:
            self.num_preparing -= 1

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet finished by the engine (the warm-up's own are nobody's)."""
        return self.engine.num_unfinished + self.num_preparing if self.is_ready else 0

    async def drain(self, grace_seconds: float) -> None:
        """Graceful shutdown: refuse new requests (503), let those in flight run for up to
        `grace_seconds`, then stop the engine, which ends each remaining stream with an error event.

        Only the engine's side ends here; the server then stops listening and waits (briefly) for
        the responses to write their last events before the process exits.
        """
        self.is_draining = True
        log.info("draining: %d request(s) in flight, up to %g s to finish; new requests get 503",
                 self.num_in_flight, grace_seconds)
        with anyio.move_on_after(grace_seconds if math.isfinite(grace_seconds) else None):
            while self.num_in_flight and not self._is_hurried:
                await anyio.sleep(0.05)
        if self.num_in_flight:
            log.warning("ending %d request(s) still in flight with an error event", self.num_in_flight)
        # Also with nothing in flight: a request still being prepared gets 503 from submit().
        await anyio.to_thread.run_sync(self.engine.shutdown)

    def hurry(self) -> None:
        """End the grace period now (a second SIGTERM or Ctrl-C)."""
        self._is_hurried = True

    def queue_full(self) -> APIError:
        self.metrics.requests_rejected.inc()
        return APIError(429, f"the server is at capacity ({self.settings.max_queue} requests); retry shortly",
                        code="queue_full", headers={"Retry-After": RETRY_AFTER_SECONDS})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            served = ", ".join(repr(name) for name in self.served_model_names)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")


class ServingState(Serving):
    """What every route needs: the engine (once warm), the model's tokenizer, settings and metrics."""

    def __init__(self, settings: ServerSettings, engine: Engine,
                 on_startup_failure: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.model = engine.model
        self._init_serving(engine.model.name, on_startup_failure)
        self.system_fingerprint = system_fingerprint(engine)
        self.tokens = TokenText(engine.model.tokenizer)
        self.reasoning = resolve(settings.reasoning_parser, settings.reasoning_config, engine.model.tokenizer)
        self.metrics = ServerMetrics()
        self.runs = RunRegistry()  # streams a client may reconnect to
        self.responses = ResponseStore(settings.responses_store_max, settings.responses_store_seconds,
                                       max(settings.stream_grace_seconds, 1.0))
        self.stream_settings = StreamSettings(settings.sse_ping_seconds, settings.slow_reader_timeout_seconds,
                                              settings.max_unread_bytes, settings.stream_resume_bytes,
                                              settings.stream_grace_seconds)

    def warm_up(self) -> None:
        """Start the engine and run one tiny generation, so numba compiles before /health says ready."""
        try:
            started = time.perf_counter()
            log.info("warming up %s (the first start compiles kernels: about a minute) ...", self.model_name)
            self.engine.start()
            bos = self.model.tokenizer.bos_token_id
            prompt = [bos if bos is not None else 0]
            for params in WARM_UP_PARAMS:
                n = min(params.n, self.engine.config.max_num_seqs)  # n > max_num_seqs is refused
                self.engine.generate(prompt, dataclasses.replace(params, n=n))
            self.metrics.attach(self.engine)  # after the warm-up, which is nobody's request
            # Everything alive now (model, tokenizer, compiled kernels, the app) lives as long as the
            # process: keep it out of the collector, so that a full collection while streams run walks
            # only what requests allocate (as vLLM does after start-up) instead of pausing every stream.
            gc.collect()
            gc.freeze()
            self.is_ready = True
            log.info("ready in %.1f s: %s, %d KV blocks of %d tokens, max_queue %d", time.perf_counter() - started,
                     self.model_name, self.engine.kv.num_total_blocks, self.engine.config.block_size,
                     self.settings.max_queue)
        except Exception as exc:  # noqa: BLE001 - whatever stops the warm-up, report it and stop serving
            self._startup_failed(exc)

def serving(request: Request) -> ServingState:
    state: ServingState = request.app.state.serving
    return state


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on the API routes; /health, /metrics
    and /openapi.json stay open for probes and scrapers (as in vLLM). CORS preflights pass:
    CORSMiddleware sits outside."""

    PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/api/", "/rerank", "/score")

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    def _is_authorized(self, header: bytes) -> bool:
        # RFC 7235 §2.1: the scheme is case-insensitive ("bearer" and "BEARER" too), the key is compared exactly
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.lstrip(b" "), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        if (scope["type"] == "http" and scope["path"].startswith(self.PROTECTED_PREFIXES)
                and not self._is_authorized(headers.get(b"authorization", b""))
                and not hmac.compare_digest(headers.get(b"x-api-key", b""), self._expected)):
            message = "a valid API key is required: Authorization: Bearer KEY (or x-api-key: KEY)"
            body = error_for_path(scope["path"], 401, message, code="invalid_api_key")
            response = encoded_response(Request(scope), body, 401, {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
