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
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> StoredResponse | None:
        return self._responses.pop(response_id, None)

    def _evict(self) -> None:
        """Forget unstored responses once finished and stored ones past their time or count (the oldest
        finished first); drop finished responses' events past `events_seconds`."""
        now = time.monotonic()
        finished = [s for s in self._responses.values() if s.state.finished_at is not None]
        for stored in finished:
            age = now - stored.state.finished_at  # type: ignore[operator]
            if not stored.state.body.store or age > self.keep_seconds:
                self.delete(stored.state.id)
            elif stored.run is not None and stored.run.num_readers == 0 and age > self.events_seconds:
                stored.run = None  # its events go; the response stays retrievable
        finished = [s for s in self._responses.values() if s.state.finished_at is not None]
        for stored in finished[: max(0, len(self._responses) - self.max_count)]:
            self.delete(stored.state.id)
