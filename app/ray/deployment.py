"""`treadle serve --ray`: treadle replicas behind Ray Serve's HTTP proxy (docs/scaling.md).

    treadle serve --ray --replicas 2 --threads-per-replica 1 --port 8000
    serve run app.ray.deployment:app_builder replicas=2 threads_per_replica=1      # the same, Ray's CLI

Two deployments:

- `TreadleReplica` (N replicas): one engine and its pool each, `threads_per_replica` threads pinned
  to the replica's own cores (its node-local rank picks them) when the node has enough; it runs the
  very app `treadle serve` runs (`app.application.build_app`), in process, one ASGI call per request —
  so routes, errors, SSE and msgpack are the single-process server's, byte for byte.
- `TreadleIngress` (one, no CPU): Ray Serve's proxy hands it each HTTP request; it reads the body,
  takes the prompt text out of it (chat: every message's role and content, in order; completions:
  the prompt) and calls a replica through a deployment handle, streaming. The handle's request
  router — Ray Serve LLM's PrefixCacheAffinityRouter (app/ray/router.py) — sends a prompt to the
  replica whose earlier prompts share the longest prefix with it, unless that replica's queue is
  `imbalanced_threshold` requests longer than another's; then the less loaded one (power of two
  choices). With `--no-prefix-affinity`, Ray's default router (power of two choices) alone.

A replica that dies mid-stream ends its streams with an error event (SSE: `data: {"error": ...}` and
`data: [DONE]`; msgpack: an error map); Ray's controller restarts it (health checks every 2 s),
and new requests go to the survivors meanwhile.

`/health` and `/metrics` at the proxy are aggregated over the replicas; `/replicas` lists them and
`/replicas/{id}/health`, `/replicas/{id}/metrics` are each one's own. Replicas report both every
second to a small registry actor (no CPU), so the proxy's view is at most about a second old.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..settings import RayOptions, ServerSettings, parse_settings

log = logging.getLogger("treadle")

APP_NAME = "treadle"
REGISTRY_NAME = "treadle_registry"
REPLICA_HEADER = "x-treadle-replica"
REPORT_SECONDS = 1.0
STALE_SECONDS = 3.0  # a replica silent this long is left out of /health and /metrics
ROUTING_PREFIX_CHARS = 8192  # routing looks at most at this much prompt text


@dataclass(slots=True)
class RoutedRequest:
    """One HTTP request as the ingress hands it to a replica. `prompt` is what the router matches
    prefixes on (PrefixCacheAffinityRouter reads `.prompt`); None when the request has none."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str | None


def routing_text(path: str, body: bytes, content_type: str) -> str | None:
    """The prompt text a request's body carries, for prefix matching; None if it has none (or is bad:
    the replica answers that one with the proper 400)."""
    if not path.startswith(("/v1/chat/completions", "/v1/completions")):
        return None
    try:
        data = msgpack.unpackb(body) if "msgpack" in content_type else json.loads(body)
    except Exception:  # noqa: BLE001 - a malformed body gets its 400 from the replica
        return None
    if not isinstance(data, dict):
        return None
    parts: list[str] = []
    if isinstance(data.get("messages"), list):
        for message in data["messages"]:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
            parts.append(f"<{message.get('role')}>{content if isinstance(content, str) else ''}\n")
    elif isinstance(data.get("prompt"), str):
        parts.append(data["prompt"])
    elif isinstance(data.get("prompt"), list):
        parts.append(" ".join(str(t) for t in data["prompt"][:ROUTING_PREFIX_CHARS]))
    text = "".join(parts)[:ROUTING_PREFIX_CHARS]
    return text or None


# ---------------------------------------------------------------------------------------------------
# The registry: replicas report health and metrics text; the ingress reads them.

@ray.remote(num_cpus=0)
class Registry:
    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, replica: str, info: dict[str, Any]) -> None:
        self._entries[replica] = (time.monotonic(), info)

    def remove(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def snapshot(self, max_age: float = STALE_SECONDS) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        return {r: info for r, (t, info) in sorted(self._entries.items()) if now - t <= max_age}


def _registry() -> Any:
    registry = Registry.options(name=REGISTRY_NAME, namespace=APP_NAME, get_if_exists=True,
                                lifetime="detached").remote()
    return registry


# ---------------------------------------------------------------------------------------------------
# A replica: the single-process app over its own engine.

def _pin_to_own_cores(local_rank: int, n_threads: int) -> list[int] | None:
    """This replica's cores: the node-local rank's slice of the usable cores, if the node has enough."""
    from threadpool.affinity import usable_cores

    cores = usable_cores()
    start = local_rank * n_threads
    if start + n_threads > len(cores):
        return None
    mine = cores[start:start + n_threads]
    os.sched_setaffinity(0, set(mine))  # this thread; the engine's pool (created next, here) pins inside it
    return mine


@serve.deployment(health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=5)
class TreadleReplica:
    def __init__(self, settings: ServerSettings) -> None:
        from decoding import Model, ModelLoadError
        from decoding.engine.engine import Engine

        from ..application import build_app
        from ..model_loading import embedder_of, load_served_model

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.to_full_id_str()  # the replica actor's name, namespace "serve"
        n_threads = settings.engine.n_threads or 1
        self.cores = _pin_to_own_cores(context.rank.local_rank, n_threads)
        config = replace(settings.engine, n_threads=n_threads, pin_threads=self.cores is not None)
        model = load_served_model(settings)
        if not isinstance(model, Model):  # an encoder: its engine and routes are a plain server's for now
            raise ModelLoadError(f"{model.name} is an embedding model; Ray replicas serve generation models "
                                 "(run `treadle serve --model NAME` without --ray)")
        self.engine = Engine(model, config)
        embeddings = (self.engine.serve_embeddings(embedder_of(model, settings))
                      if settings.task == "generate,embed" else None)  # fmt: skip
        self.app = build_app(settings, self.engine, embeddings=embeddings)
        self.state = self.app.state.serving
        self.state.warm_up()  # before Ray marks this replica running: no request meets a cold engine
        if self.state.startup_error:
            raise RuntimeError(f"treadle replica failed to start: {self.state.startup_error}")
        self._stop = threading.Event()
        self._registry = _registry()
        threading.Thread(target=self._report_loop, name="treadle-ray-report", daemon=True).start()

    def _report_loop(self) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        while not self._stop.is_set():
            try:
                self._registry.report.remote(self.replica_id, {
                    "status": "ok" if self.state.is_ready and not self.state.is_draining else "unavailable",
                    "node_id": node_id, "cores": self.cores, "in_flight": self.state.num_in_flight,
                    "metrics": self.state.metrics.render().decode()})
            except Exception:  # noqa: BLE001, S110 - a report lost is the next one's to make
                pass
            self._stop.wait(REPORT_SECONDS)

    def check_health(self) -> None:
        if self.state.startup_error or self.state.is_draining:
            raise RuntimeError(self.state.startup_error or "draining")

    async def handle(self, request: RoutedRequest):  # type: ignore[no-untyped-def]
        """Run one request through the app; yield (status, headers) first, then the body's pieces."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request.method, "path": request.path, "raw_path": request.path.encode(),
                 "root_path": "", "query_string": request.query_string, "headers": request.headers,
                 "client": None, "server": None}
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.get_running_loop().create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        complete = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                    yield (message["status"], headers)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        complete = True
                        break
        finally:
            if not complete:  # the client went away (Ray cancelled this generator): the app aborts it
                disconnected.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except BaseException:  # noqa: BLE001 - cancelled or stuck: stop it
                task.cancel()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            try:
                self._registry.remove.remote(self.replica_id)
            except Exception:  # noqa: BLE001, S110 - the registry drops it when stale anyway
                pass
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# ---------------------------------------------------------------------------------------------------
# The ingress: HTTP in, a replica chosen by the router, the replica's response streamed back.

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?(\s.*)$")


def relabel(metrics_text: str, replica: str, seen: set[str]) -> list[str]:
    """Prometheus text with `replica="..."` on every sample; HELP/TYPE lines once per metric."""
    lines = []
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            if line not in seen:
                seen.add(line)
                lines.append(line)
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, _, labels, rest = match.groups()
        label = f'replica="{replica}"'
        lines.append(f"{name}{{{label}{',' + labels if labels else ''}}}{rest}")
    return lines


def _short(replica_id: str) -> str:
    return replica_id.rsplit("#", 1)[-1]


def _stream_error_event(content_type: str, message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_died"}}
    if "msgpack" in content_type:
        return msgpack.packb(error)
    if "event-stream" in content_type:
        return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    return b""  # a plain body cut short: the client sees a broken response (its length is short)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
class TreadleIngress:
    def __init__(self, replicas: DeploymentHandle, settings: ServerSettings) -> None:
        self.replicas = replicas.options(stream=True)
        self.settings = settings
        self.registry = _registry()

    async def _snapshot(self) -> dict[str, dict[str, Any]]:
        return await self.registry.snapshot.remote()

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path in ("/health", "/metrics") or path.startswith("/replicas"):
            return await self._replica_info(request, path)
        body = await request.body()
        routed = RoutedRequest(request.method, path, request.scope.get("query_string", b""),
                               list(request.scope["headers"]), body,
                               routing_text(path, body, request.headers.get("content-type", "")))
        stream = self.replicas.handle.remote(routed)
        try:
            status, headers = await stream.__anext__()
        except StopAsyncIteration:
            return JSONResponse({"error": {"message": "the replica sent no response", "type": "server_error",
                                           "param": None, "code": None}}, 500)
        except Exception as exc:  # noqa: BLE001 - the replica died before answering
            return JSONResponse({"error": {"message": f"the replica failed: {type(exc).__name__}",
                                           "type": "server_error", "param": None, "code": "replica_died"}},
                                503, headers={"Retry-After": "1"})
        content_type = next((v.decode() for k, v in headers if k.lower() == b"content-type"), "")

        async def body_pieces():  # type: ignore[no-untyped-def]
            finished = False
            try:
                async for piece in stream:
                    yield piece
                finished = True
            except Exception as exc:  # noqa: BLE001 - the replica died mid-stream
                log.warning("replica failed mid-response: %s", type(exc).__name__)
                yield _stream_error_event(content_type, f"the replica serving this request failed "
                                          f"({type(exc).__name__}); retry")
                finished = True
            finally:
                if not finished:  # the client left: cancel the replica's side, which aborts the request
                    stream.cancel()

        response = StreamingResponse(body_pieces(), status_code=status)
        response.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        return response

    async def _replica_info(self, request: Request, path: str) -> Response:
        replicas = await self._snapshot()
        by_short = {_short(r): r for r in replicas}
        if path == "/health":
            statuses = {_short(r): info["status"] for r, info in replicas.items()}
            ok = any(s == "ok" for s in statuses.values())
            return JSONResponse({"status": "ok" if ok else "unavailable", "replicas": statuses}, 200 if ok else 503)
        if path == "/metrics":
            seen: set[str] = set()
            lines = ["# HELP treadle_replicas_up Replicas that reported in the last few seconds.",
                     "# TYPE treadle_replicas_up gauge", f"treadle_replicas_up {len(replicas)}"]
            for replica, info in replicas.items():
                lines += relabel(info["metrics"], _short(replica), seen)
            return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
        if path.rstrip("/") == "/replicas":
            return JSONResponse({"replicas": [{"id": _short(r), "actor": r, "status": info["status"],
                                               "node_id": info["node_id"], "cores": info["cores"],
                                               "in_flight": info["in_flight"]} for r, info in replicas.items()]})
        parts = path.strip("/").split("/")
        if len(parts) == 3 and parts[1] in by_short and parts[2] in ("health", "metrics"):
            info = replicas[by_short[parts[1]]]
            if parts[2] == "metrics":
                return PlainTextResponse(info["metrics"], media_type="text/plain; version=0.0.4")
            return JSONResponse({"status": info["status"]}, 200 if info["status"] == "ok" else 503)
        return JSONResponse({"error": {"message": f"no replica route {path}", "type": "invalid_request_error",
                                       "param": None, "code": None}}, 404)


# ---------------------------------------------------------------------------------------------------
# Building and running the application.

def build_application(settings: ServerSettings, replicas: int = 2, threads_per_replica: int = 1,
                      prefix_affinity: bool = True, imbalanced_threshold: float | None = None) -> Any:
    """The Ray Serve application: `serve.run(build_application(...))`."""
    settings = replace(settings, engine=replace(settings.engine, n_threads=threads_per_replica))
    if prefix_affinity:
        from .router import DEFAULT_IMBALANCED_THRESHOLD, TreadlePrefixRouter

        router = RequestRouterConfig(request_router_class=TreadlePrefixRouter, request_router_kwargs={
            "imbalanced_threshold": DEFAULT_IMBALANCED_THRESHOLD if imbalanced_threshold is None
            else imbalanced_threshold})
    else:
        router = RequestRouterConfig()
    # max_ongoing_requests is the engine's own bound (max_queue: running + waiting), not max_num_seqs: Ray's
    # "queue length" of a replica is its ongoing requests, engine-waiting ones included, and the prefix
    # router leaves a replica holding the prefix once that count is `imbalanced_threshold` above another's
    # (tests/test_ray_serve.py: 5 of 12 same-prefix streams stay, the rest spill), so spilling over needs
    # no small cap here (a replica at the cap gets nothing more: the router probes it and looks elsewhere).
    replica = TreadleReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": threads_per_replica},
                                     max_ongoing_requests=settings.max_queue,
                                     request_router_config=router).bind(settings)
    return TreadleIngress.bind(replica, settings)


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run app.ray.deployment:app_builder replicas=2 threads_per_replica=1 kv_cache_mb=128 ...`:
    `replicas`, `threads_per_replica`, `prefix_affinity` (true/false), and any `treadle serve` option
    by its flag name with underscores."""
    args = dict(args)
    replicas = int(args.pop("replicas", 2))
    threads = int(args.pop("threads_per_replica", 1))
    affinity = str(args.pop("prefix_affinity", "true")).lower() in ("1", "true", "yes", "on")
    argv = [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return build_application(parse_settings(argv), replicas, threads, affinity)


def main(settings: ServerSettings, ours: RayOptions) -> int:
    """`treadle serve --ray ...` (its options: app/settings.py, the "Ray Serve" group)."""
    logging.basicConfig(level=logging.INFO, format="treadle: %(message)s")
    if ours.ray_address:
        ray.init(address=ours.ray_address)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, ours.replicas * ours.threads_per_replica))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings, ours.replicas, ours.threads_per_replica, ours.prefix_affinity),
                  name=APP_NAME, route_prefix="/")
        print(f"treadle: {ours.replicas} replica(s) x {ours.threads_per_replica} thread(s) on "
              f"http://{settings.host}:{settings.port} (Ray Serve; prefix affinity "
              f"{'on' if ours.prefix_affinity else 'off'})", file=sys.stderr)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
