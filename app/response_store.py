"""The Responses API's store: responses by id, in memory — those running, and finished ones created
with `store: true` for a bounded time and count."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from .responses_protocol import ResponseState
from .runs import Run


@dataclass(slots=True)
class StoredResponse:
    state: ResponseState
    run: Run | None  # its events, while kept
    finished_at: float | None = None


class ResponseStore:
    """Responses by id: those running, and finished ones created with `store` for a bounded time and
    count (the oldest finished go first). A finished response keeps its events for `events_seconds`."""

    def __init__(self, max_count: int, keep_seconds: float, events_seconds: float) -> None:
        self.max_count = max_count
        self.keep_seconds = keep_seconds
        self.events_seconds = events_seconds
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def add(self, stored: StoredResponse) -> None:
        self._responses[stored.state.id] = stored
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        self._evict()
        stored = self._responses.get(response_id)
        if stored is not None:
            self._on_progress(stored)
        return stored

    def delete(self, response_id: str) -> StoredResponse | None:
        return self._responses.pop(response_id, None)

    def _on_progress(self, stored: StoredResponse) -> None:
        if stored.finished_at is None and stored.state.is_finished:
            stored.finished_at = time.monotonic()
            if not stored.state.body.store:
                self.delete(stored.state.id)
        if (stored.run is not None and stored.finished_at is not None and stored.run.num_readers == 0
                and time.monotonic() - stored.finished_at > self.events_seconds):
            stored.run = None  # its events go; the response stays retrievable

    def _evict(self) -> None:
        now = time.monotonic()
        for stored in list(self._responses.values()):
            self._on_progress(stored)
        finished = [s for s in self._responses.values() if s.finished_at is not None]
        for stored in finished:
            if now - stored.finished_at > self.keep_seconds:  # type: ignore[operator]
                self.delete(stored.state.id)
        finished = [s for s in self._responses.values() if s.finished_at is not None]
        for stored in finished[: max(0, len(self._responses) - self.max_count)]:
            self.delete(stored.state.id)

    def __len__(self) -> int:
        return len(self._responses)
