"""Delivering one request's outputs: one body (aborted in the engine when its client leaves), or a
stream — an SSE or msgpack connection reading a run (runs.py), which a client that lost its connection
can read again from where it was cut.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgpack
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from decoding.engine.outputs import RequestOutput

from .errors import MSGPACK, encoded_response, error_body, wants_msgpack
from .outcomes import api_error, first_failure
from .protocol import Chunk, merge_outputs
from .runs import Event, EventsGone, Generation, Run, RunRegistry

log = logging.getLogger("treadle")


@dataclass(frozen=True, slots=True)
class Framing:
    """How events go on the wire, and how the end of the stream is marked."""

    encode: Callable[[Event], bytes]
    end: bytes


# SSE ends lines at CR or LF only, but line readers that split like str.splitlines (httpx's iter_lines,
# many hand-written clients) also break at NEL, LINE and PARAGRAPH SEPARATOR, which JSON leaves
# unescaped and models do emit: escaped, they cannot cut a `data:` line in two.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(chunk: Chunk) -> bytes:
    text = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS)
    return b"data: " + text.encode() + b"\n\n"


def _event_id(event: Event) -> bytes:
    """`id:` is the event's number: a client that reconnects sends the last it saw as Last-Event-ID. An
    event outside the numbering (an error about the stream itself) has none, so it moves no client's id."""
    return b"id: %d\n" % event.number if event.number >= 0 else b""


def _sse_event(event: Event) -> bytes:
    return _event_id(event) + sse_data(event.chunk)


def _typed_sse_event(event: Event) -> bytes:
    """The Responses API's events: the type in the `event:` line too, as OpenAI sends them."""
    return _event_id(event) + b"event: %s\n" % event.chunk["type"].encode() + sse_data(event.chunk)


SSE_FRAMING = Framing(_sse_event, b"data: [DONE]\n\n")
TYPED_SSE_FRAMING = Framing(_typed_sse_event, b"")  # a Responses stream ends after response.completed
MSGPACK_FRAMING = Framing(lambda event: msgpack.packb(event.chunk), msgpack.packb({"done": True}))
NDJSON = "application/x-ndjson"
# Ollama's streams: one JSON object per line; the last says "done": true itself
NDJSON_FRAMING = Framing(lambda event: json.dumps(event.chunk, ensure_ascii=False).encode() + b"\n", b"")


@dataclass(frozen=True, slots=True)
class StreamSettings:
    ping_seconds: float
    send_timeout_seconds: float | None  # a write blocked this long ends the connection (not the run)
    max_unread_bytes: int
    keep_bytes: int
    grace_seconds: float


async def respond(request: Request, generation: Generation, is_streamed: bool, settings: StreamSettings,
                  runs: RunRegistry) -> Response:
    """A whole response, or a stream: its run is registered, so a client that loses the connection can
    reconnect to it (`resume_stream`)."""
    if not is_streamed:
        return await _whole_response(request, generation)
    run = runs.add(new_run(generation, settings))
    return stream_run(request, run, -1, settings)


def new_run(generation: Generation, settings: StreamSettings, is_background: bool = False) -> Run:
    return Run(generation, max_unread_bytes=settings.max_unread_bytes, keep_bytes=settings.keep_bytes,
               grace_seconds=settings.grace_seconds, is_background=is_background).start()


def stream_run(request: Request, run: Run, after: int, settings: StreamSettings,
               framing: Framing = SSE_FRAMING) -> Response:
    """A run's events after number `after` (-1: all), then the live ones, over SSE or msgpack."""
    if wants_msgpack(request):
        return MsgpackStreamResponse(run, lambda response: _relay(run, after, MSGPACK_FRAMING, response),
                                     media_type=MSGPACK, send_timeout_seconds=settings.send_timeout_seconds)
    return SSEResponse(run, lambda response: _relay(run, after, framing, response), sep="\n",
                       ping=settings.ping_seconds, ping_message_factory=PingComment,
                       send_timeout=settings.send_timeout_seconds)


def ndjson_run(run: Run, settings: StreamSettings) -> Response:
    """A run's events as NDJSON lines (Ollama's streams): no ids, no pings, so no resuming."""
    return MsgpackStreamResponse(run, lambda response: _relay(run, -1, NDJSON_FRAMING, response), media_type=NDJSON,
                                 send_timeout_seconds=settings.send_timeout_seconds)


class PingComment(ServerSentEvent):
    """`: ping` and no blank line: a comment line alone dispatches nothing. The openai package (and any
    parser that keeps the last event id, as the spec says, but then dispatches whenever an id is set)
    turns the blank line after a comment into an event with empty data, which it fails to parse."""

    def encode(self) -> bytes:
        return b": ping\n"


async def _relay(run: Run, after: int, framing: Framing, response: RunResponse) -> AsyncGenerator[bytes, None]:
    """One connection's body: the run's events from `after` on. Leaving early (the client left) ends
    only this connection; the run decides what happens to the generation."""
    try:
        async for event in run.follow(after):
            # The response resumes us once it has written the event: a write that does not come back
            # means a client that does not read, and the engine pauses its request.
            run.reader_writes(True)
            yield framing.encode(event)
            run.reader_writes(False)
    except EventsGone as exc:  # a reconnect that fell behind what a long stream keeps
        yield framing.encode(Event(-1, error_body(410, str(exc), code="events_expired"), 0))
    if framing.end:
        yield framing.end
    response.read_to_the_end = True


class RunResponse(Protocol):
    read_to_the_end: bool


async def _whole_response(request: Request, generation: Generation) -> Response:
    """Collect every delta, racing the client: starlette does not cancel a plain request whose client
    left, so without the watcher a vanished client's request would run to its last token."""
    outputs: list[RequestOutput] = []

    async def collect() -> None:
        async for output in generation.stream:
            generation.token_gaps.observe(output)
            outputs.append(output)

    try:
        is_complete = await run_until_disconnect(request.receive, collect)
    finally:
        generation.abort_unless_finished()
    if not is_complete:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    merged = merge_outputs(outputs)
    failed = first_failure(merged)
    if failed is not None:
        raise api_error(failed)
    return encoded_response(request, generation.formatter.response(merged))


async def run_until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run `work` unless the client disconnects first (then cancel it); True if it completed."""
    is_complete = False
    async with anyio.create_task_group() as task_group:

        async def run_work() -> None:
            nonlocal is_complete
            await work()
            is_complete = True
            task_group.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            task_group.cancel_scope.cancel()

        task_group.start_soon(run_work)
        task_group.start_soon(watch_disconnect)
    return is_complete


class SSEResponse(EventSourceResponse):
    """sse-starlette's response (pings, disconnect watcher, send timeouts) as one reader of a run: it
    counts as the run's reader from before its body starts (a client that leaves before then still
    detaches), and sends no ping after the last event: sse-starlette's ping task could otherwise write
    one between `data: [DONE]` and the end of the response (clients that stop at [DONE] never see it;
    strict parsers and tests that check the stream's end do)."""

    def __init__(self, run: Run, content: Callable[[RunResponse], AsyncGenerator[bytes, None]], *args: Any,
                 **kwargs: Any) -> None:
        self.run = run
        self.read_to_the_end = False
        super().__init__(self._then_stop_pinging(content(self)), *args, **kwargs)

    async def _then_stop_pinging(self, content: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        try:
            async for chunk in content:
                yield chunk
            self.active = False  # the last chunk is written (we were resumed after it): pings stop here
        finally:
            await content.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.run.attach()
        try:
            await super().__call__(scope, receive, send)
        except TimeoutError:  # sse-starlette's send timeout: the client stopped reading
            log.warning("ended a connection of %s: its client read nothing for %g s", self.run.id,
                        self.send_timeout)
        finally:
            self.run.detach(self.read_to_the_end)


class MsgpackStreamResponse(StreamingResponse):
    """A run's events in a plain body (msgpack maps, NDJSON lines). Starlette's StreamingResponse stops
    watching `http.disconnect` on ASGI ≥ 2.4 servers and then
    notices a vanished client only when a send fails — never while a request waits in the queue.
    This one always races the body against the disconnect, and detaches from its run on every way out."""

    def __init__(self, run: Run, content: Callable[[RunResponse], AsyncGenerator[bytes, None]], *args: Any,
                 send_timeout_seconds: float | None = None, **kwargs: Any) -> None:
        self.run = run
        self.read_to_the_end = False
        super().__init__(content(self), *args, **kwargs)
        self.send_timeout_seconds = send_timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Any) -> None:
            with anyio.fail_after(self.send_timeout_seconds):
                await send(message)

        self.run.attach()
        try:
            await run_until_disconnect(receive, lambda: self.stream_response(send_or_give_up))
        except* TimeoutError:  # raised inside run_until_disconnect's task group
            log.warning("ended a connection of %s: its client read nothing for %g s", self.run.id,
                        self.send_timeout_seconds)
        finally:
            self.run.detach(self.read_to_the_end)
