"""Streams that outlive their connection: a run turns one request's outputs into numbered events and
keeps them, so that any reader can follow from any kept event — the connection that asked, and one that
reconnects after a network drop (`Last-Event-ID`), or a Responses client streaming `starting_after=N`.

A pump task reads the engine's stream and formats it into events as they come; readers only follow
the kept events, so a reader that comes and goes changes nothing for the generation. What a run keeps
is bounded twice: the events not yet sent to any reader by `max_unread_bytes` (past it the pump stops
taking output and tells the engine its reader is blocked, so the engine pauses the request and ends it
after the slow-reader timeout, as it would for a client that stopped reading), and all kept events by
`keep_bytes` (past it the oldest events already sent are dropped; a reconnect from before them is
answered 410).

When the last reader of an unfinished run leaves, the run is kept for `grace_seconds` for a reconnect
to find it, then is aborted (0: at once); meanwhile its request is paused (its KV kept, nothing
generated for nobody, first to be preempted) and a reconnect resumes it. A finished run is kept as long
again, for a reader that lost the connection just before the end; one whose every event reached a reader
that read to the end goes at once. Background runs (Responses API `background: true`) belong to no
connection: they run to the end whoever reads, and are dropped by their owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from decoding.engine.engine import Engine
from decoding.engine.outputs import RequestOutput, RequestStream

from .metrics import TokenGapTimer
from .protocol import Chunk

log = logging.getLogger("treadle")


@dataclass(slots=True)
class Event:
    number: int  # 0, 1, ... within the run: the SSE `id`, the Responses API's `sequence_number`; -1: none
    chunk: Chunk
    size: int  # about its bytes on the wire


class EventsGone(Exception):
    """A reader asked for events the run no longer keeps."""


class Formatter(Protocol):
    """Engine outputs → API objects: the chunks of a stream's start, of each output and of its end (what
    a run needs), or one whole response."""

    def first_chunks(self) -> list[Chunk]: ...
    def chunks(self, output: RequestOutput) -> list[Chunk]: ...
    def last_chunks(self) -> list[Chunk]: ...
    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]: ...


@dataclass(slots=True)
class Generation:
    """A submitted request and what its delivery needs."""

    engine: Engine
    stream: RequestStream
    formatter: Formatter
    token_gaps: TokenGapTimer

    def abort_unless_finished(self) -> None:
        if not self.stream.is_finished:
            self.engine.abort(self.stream.request_id)


def chunk_size(chunk: Chunk) -> int:
    """A cheap estimate of a chunk's size on the wire, for the bounds (exactness does not matter)."""
    size = 64
    stack: list[Any] = [chunk]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            size += 8 * len(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            size += 2 * len(value)
            stack.extend(value)
        elif isinstance(value, str):
            size += len(value) + 2
        else:
            size += 8
    return size


class Run:
    RECHECK_SECONDS = 0.25  # how often a held pump looks whether the engine ended the request

    def __init__(self, generation: Generation, *, max_unread_bytes: int, keep_bytes: int, grace_seconds: float,
                 is_background: bool = False) -> None:
        self.generation = generation
        self.stream = generation.stream
        self.id = self.stream.request_id
        self.max_unread_bytes = max_unread_bytes
        self.keep_bytes = keep_bytes
        self.grace_seconds = grace_seconds
        self.is_background = is_background
        self._on_forget: Callable[[Run], None] | None = None  # set by the registry that holds it
        self.events: deque[Event] = deque()
        self.num_events = 0  # numbered so far (kept or dropped)
        self.num_kept_bytes = 0
        self.num_sent = 0  # events before this number reached some reader
        self.num_sent_bytes = 0  # of the kept events before num_sent
        self.is_done = False  # every event is in; `events` only shrinks from now on
        self.num_readers = 0
        self._changed = asyncio.Event()
        self._abandon_timer: asyncio.TimerHandle | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._is_pump_waiting = False

    # ---- the pump -------------------------------------------------------------------------------

    def start(self) -> Run:
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(), name=f"run {self.id}")
        return self

    async def _pump(self) -> None:
        try:
            formatter = self.generation.formatter
            self._append_all(formatter.first_chunks())
            async for output in self.stream:
                self.generation.token_gaps.observe(output)
                self._append_all(formatter.chunks(output))
                await self._wait_for_room()
            self._append_all(formatter.last_chunks())
        except Exception:  # a formatting fault ends this run, never the server
            log.exception("run %s failed", self.id)
            self.abort_generation()
            self._append_all([{"error": {"message": "internal error while streaming", "type": "server_error",
                                         "param": None, "code": None}}])
        finally:
            self.is_done = True
            self._notify()
            if self.num_readers == 0:
                self._schedule_forget()

    def _append_all(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            event = Event(self.num_events, chunk, chunk_size(chunk))
            self.num_events += 1
            self.events.append(event)
            self.num_kept_bytes += event.size
        if chunks:
            self._trim()
            self._notify()

    def _trim(self) -> None:
        """Drop the oldest events past `keep_bytes`: those already sent (all of them, for a background run)."""
        events = self.events
        while self.num_kept_bytes > self.keep_bytes and events and (
                events[0].number < self.num_sent or self.is_background):
            event = events.popleft()
            self.num_kept_bytes -= event.size
            if event.number < self.num_sent:
                self.num_sent_bytes -= event.size

    @property
    def num_unread_bytes(self) -> int:
        return self.num_kept_bytes - self.num_sent_bytes

    async def _wait_for_room(self) -> None:
        """Hold the pump while too much waits unsent: the engine sees a blocked reader and pauses the request."""
        if self.is_background or self.num_unread_bytes <= self.max_unread_bytes:
            return
        self.stream.reader_writes(True)
        self._is_pump_waiting = True
        try:
            while self.num_unread_bytes > self.max_unread_bytes and not self.stream.is_finished:
                # a reader taking events wakes us; the engine ending the request (aborted as a slow
                # reader, or by the grace period) does not, so look again now and then
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.RECHECK_SECONDS)
        finally:
            self._is_pump_waiting = False
            self.stream.reader_writes(False)

    def _notify(self) -> None:
        """Wake every reader waiting for an event, and the pump waiting for room."""
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- readers --------------------------------------------------------------------------------

    def attach(self) -> None:
        """A connection begins to read (or will): the run is not abandoned while one does."""
        self.num_readers += 1
        self.stream.set_unattended(False)
        if self._abandon_timer is not None:
            self._abandon_timer.cancel()
            self._abandon_timer = None

    def detach(self, read_to_the_end: bool = False) -> None:
        """A connection ended; `read_to_the_end`: it was sent every event and the end of the stream."""
        self.num_readers -= 1
        self.stream.reader_writes(False)  # a write it was blocked in no longer holds the request
        if self.num_readers:
            return
        if read_to_the_end and self.is_done and not self.is_background:
            self.forget()
        elif not self.is_background:
            self.stream.set_unattended(True)  # paused, its KV kept, until a reconnect or the grace's end
            self._schedule_forget()

    def _schedule_forget(self) -> None:
        if self.is_background or self._abandon_timer is not None:
            return
        if self.grace_seconds <= 0:
            self.forget()
            return
        self._abandon_timer = asyncio.get_running_loop().call_later(self.grace_seconds, self.forget)

    def forget(self) -> None:
        """Abort the generation if it still runs, and leave the registry: nobody will read it any more."""
        self._abandon_timer = None
        if self.num_readers and not self.is_background:
            return
        self.abort_generation()
        if self._on_forget is not None:
            self._on_forget(self)

    def abort_generation(self) -> None:
        self.generation.abort_unless_finished()

    def reader_writes(self, is_writing: bool) -> None:
        self.stream.reader_writes(is_writing)

    def check_kept(self, after: int) -> None:
        """Raise unless every event after number `after` (-1: from the start) is still kept: EventsGone
        if some were dropped, ValueError if `after` is not an event of this run. (A number the run has
        not reached yet is fine while it runs: the reader waits for the events after it.)"""
        if after < -1 or (self.is_done and after >= self.num_events):
            raise ValueError(f"this stream has no event {after} (it has events 0-{self.num_events - 1})")
        first_kept = self.events[0].number if self.events else self.num_events
        if after + 1 < first_kept:
            raise EventsGone(f"events {after + 1}-{first_kept - 1} of this stream are no longer kept")

    async def follow(self, after: int = -1) -> AsyncIterator[Event]:
        """The events after number `after`, then each as it comes, to the end of the run."""
        self.check_kept(after)
        number = after + 1
        while True:
            changed = self._changed
            events = self.events
            first_kept = events[0].number if events else self.num_events
            if number < first_kept:
                raise EventsGone(f"events from {number} were dropped while this reader lagged")
            if number - first_kept < len(events):
                event = events[number - first_kept]
                yield event
                number += 1
                self._mark_sent(event)
            elif self.is_done:
                return
            else:
                await changed.wait()

    def _mark_sent(self, event: Event) -> None:
        if event.number < self.num_sent:
            return  # a reader replaying what another was sent
        self.num_sent = event.number + 1
        self.num_sent_bytes += event.size
        if self._is_pump_waiting:
            self._notify()


class RunRegistry:
    """The runs a reconnect may find, by id."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}

    def add(self, run: Run) -> Run:
        self._runs[run.id] = run
        run._on_forget = self._forget
        return run

    def _forget(self, run: Run) -> None:
        if self._runs.get(run.id) is run:
            del self._runs[run.id]

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)
