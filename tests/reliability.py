"""Helpers of the reliability tests (tests/test_reliability_*.py): servers with options or an environment
of their own, and streams read on threads so that a test can act while they run."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import httpx

from bench.sse import iter_sse_data

from . import tinymodel
from .conftest_server import TreadleServer


@contextmanager
def running_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[TreadleServer]:
    """A `treadle serve` of its own, stopped when the block ends: with SIGTERM, and it must exit 0."""
    with mock.patch.dict(os.environ, env or {}):  # the server process copies this environment
        server = TreadleServer(args)
    try:
        yield server.wait_ready()
    except BaseException:
        server.stop()
        raise
    # Whatever the test did to it, a server still running drains and exits 0 on SIGTERM.
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0, server.log()[-3000:]
    server.stop()


class StreamReader(threading.Thread):
    """POSTs a streamed request and keeps every SSE `data:` payload."""

    def __init__(self, base_url: str, path: str, body: dict[str, object]) -> None:
        super().__init__(daemon=True)
        self.url = base_url + path
        self.body = {**body, "stream": True}
        self.status: int | None = None
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.is_over = False
        self._new_event = threading.Condition()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300) as response:
                self.status = response.status_code
                for data in iter_sse_data(response.iter_bytes()):
                    with self._new_event:
                        self.events.append(data)
                        self._new_event.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
        finally:
            with self._new_event:
                self.is_over = True
                self._new_event.notify_all()

    def wait_events(self, count: int = 1, timeout: float = 120) -> StreamReader:
        """Until `count` events arrived (or the stream ended)."""
        with self._new_event:
            assert self._new_event.wait_for(lambda: len(self.events) >= count or self.is_over, timeout), \
                f"fewer than {count} events from {self.url} within {timeout} s"
        return self

    def finish(self, timeout: float = 300) -> list[str]:
        self.join(timeout)
        assert not self.is_alive(), f"the stream from {self.url} did not end within {timeout} s"
        assert self.error is None, f"the stream from {self.url} failed: {self.error!r}"
        assert self.status == 200, self.status
        return self.events

    def text(self) -> str:
        """The streamed text of choice 0 (chat deltas or completion text)."""
        pieces = []
        for payload in self.events[:-1]:
            for choice in json.loads(payload).get("choices", []):
                if choice["index"] == 0:
                    pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(pieces)


def write_tiny_gguf(path: Path, chat_template: str) -> Path:
    """tests/tinymodel's random GGUF model, with the chat template given (it reads the module's constant)."""
    with mock.patch.object(tinymodel, "CHAT_TEMPLATE", chat_template):
        return tinymodel.write_gguf(path)
