"""Real `treadle serve` processes on loopback for the app tests, shared across test modules.

A server is started on first use and kept until the test session ends, so the modules that need the
same configuration share one process (loading the model and warming up costs seconds each time).
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.prometheus import parse_metrics
from bench.servers import ServerLog, free_port, stop, wait_until_ready

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 600  # a cold numba cache compiles every kernel before the server is ready
API_KEY = "test-key-5f1c"
CORS_ORIGIN = "http://chat.example.test"

# name -> `treadle serve` options. "main" serves most tests; "guarded" has a key, CORS, a tiny
# queue, one sequence at a time and fast pings, for the overload, auth, CORS and queued-client tests.
CONFIGS = {
    # exact kernels: greedy text through the API is compared with transformers' continuations
    # a stream whose client left runs on for 3 s (reconnect tests), then is aborted (disconnect tests)
    "main": ["--kv-cache-mb", "128", "--max-num-seqs", "8", "--max-queue", "16", "--sse-ping-seconds", "0.5",
             "--kernels", "exact", "--stream-grace-seconds", "3"],
    "guarded": ["--kv-cache-mb", "128", "--max-num-seqs", "1", "--max-queue", "2", "--sse-ping-seconds", "0.2",
                "--api-key", API_KEY, "--cors-origins", CORS_ORIGIN, "--max-body-bytes", "65536", "--threads", "1",
                "--stream-grace-seconds", "0"],
}


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class TreadleServer:
    def __init__(self, args: list[str], api_key: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._log = ServerLog("treadle-serve-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO, env=server_env(), stdout=self._log.file, stderr=subprocess.STDOUT,
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> TreadleServer:
        why_not = wait_until_ready(self.process, f"{self.base_url}/health", timeout)
        if why_not is not None:
            raise RuntimeError(f"treadle serve {why_not}:\n{self.log()}")
        return self

    def log(self) -> str:
        return self._log.text()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed like `name{label="value"}` (or just `name`)."""
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=10).text)

    def wait_for_metrics(self, predicate: Callable[[dict[str, float]], bool], timeout: float = 60) -> dict[str, float]:
        """Poll /metrics until `predicate` holds; the timeout only bounds a failing test."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            if predicate(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never satisfied the condition: {samples}")
            time.sleep(0.05)

    def stop(self) -> None:
        stop(self.process)
        self._log.close()  # the tests that read it did so while it ran


_servers: dict[str, TreadleServer] = {}


def shared_server(name: str) -> TreadleServer:
    """The server of configuration `name`, started on first use (all are stopped at exit)."""
    if name not in _servers:
        args = CONFIGS[name]
        _servers[name] = TreadleServer(args, API_KEY if "--api-key" in args else None)
    return _servers[name].wait_ready()


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        server.stop()


def raw_request(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> socket.socket:
    """A POST written by hand on a plain socket, so a test can close the connection whenever it likes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    received = b""
    while marker not in received:
        chunk = sock.recv(4096)
        if not chunk or len(received) > limit:
            raise AssertionError(f"connection ended before {marker!r}: {received[-500:]!r}")
        received += chunk
    return received
