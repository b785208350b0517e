"""Delivering one request's outputs — an SSE stream, a msgpack stream or one body — and aborting it
in the engine on every way out: finished, failed, client gone (streamed or not), server stopping.
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

from decoding.engine.engine import Engine
from decoding.engine.outputs import RequestOutput, RequestStream

from .errors import MSGPACK, APIError, encoded_response, wants_msgpack
from .metrics import TokenGapTimer
from .protocol import Chunk, merge_outputs

log = logging.getLogger("treadle")


class Formatter(Protocol):
    def first_chunks(self) -> list[Chunk]: ...
    def chunks(self, output: RequestOutput) -> list[Chunk]: ...
    def last_chunks(self) -> list[Chunk]: ...
    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Framing:
    """How chunks go on the wire, and how the end of the stream is marked."""

    encode: Callable[[Chunk], bytes]
    end: bytes


# SSE ends lines at CR or LF only, but line readers that split like str.splitlines (httpx's iter_lines,
# many hand-written clients) also break at NEL, LINE and PARAGRAPH SEPARATOR, which JSON leaves
# unescaped and models do emit: escaped, they cannot cut a `data:` line in two.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse_event(chunk: Chunk) -> bytes:
    text = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS)
    return b"data: " + text.encode() + b"\n\n"


SSE_FRAMING = Framing(_sse_event, b"data: [DONE]\n\n")
MSGPACK_FRAMING = Framing(msgpack.packb, msgpack.packb({"done": True}))


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


async def respond(request: Request, generation: Generation, is_streamed: bool, ping_seconds: float,
                  send_timeout_seconds: float | None = None) -> Response:
    """`send_timeout_seconds`: a write to a client that reads nothing for this long ends the stream (and
    the request), so a stalled connection holds neither the engine's output nor a socket for ever."""
    if not is_streamed:
        return await _whole_response(request, generation)
    if wants_msgpack(request):
        return MsgpackStreamResponse(generation, _relay(generation, MSGPACK_FRAMING), media_type=MSGPACK,
                                     send_timeout_seconds=send_timeout_seconds)
    return SSEResponse(generation, _relay(generation, SSE_FRAMING), sep="\n", ping=ping_seconds,
                       ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"),
                       send_timeout=send_timeout_seconds)


async def _relay(generation: Generation, framing: Framing) -> AsyncGenerator[bytes, None]:
    """The stream's body. Its `finally` runs on completion, on cancellation (the client left: the
    response cancels us) and on close, so the engine never generates for nobody."""
    formatter = generation.formatter
    stream = generation.stream
    try:
        for chunk in formatter.first_chunks():
            yield framing.encode(chunk)
        async for output in stream:
            generation.token_gaps.observe(output)
            for chunk in formatter.chunks(output):
                # The response resumes us once it has written the chunk: a write that does not come
                # back means a client that does not read, and the engine pauses its request.
                stream.reader_writes(True)
                yield framing.encode(chunk)
                stream.reader_writes(False)
        for chunk in formatter.last_chunks():
            yield framing.encode(chunk)
        yield framing.end
    finally:
        generation.abort_unless_finished()


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
    failed = next((o for o in merged if o.finish_reason in ("error", "abort")), None)
    if failed is not None and failed.finish_reason == "error":
        raise APIError(500, failed.error or "generation failed")
    if failed is not None:
        raise APIError(503, "the server is shutting down", code="shutting_down")
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
    """sse-starlette's response (pings, disconnect watcher, send timeouts), plus the abort for a client
    that left before the body's generator ever started (its `finally` would then never run), and no
    ping after the last event: sse-starlette's ping task could otherwise write one between
    `data: [DONE]` and the end of the response (clients that stop at [DONE] never see it; strict
    parsers and tests that check the stream's end do)."""

    def __init__(self, generation: Generation, content: AsyncGenerator[bytes, None], *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(self._then_stop_pinging(content), *args, **kwargs)
        self.generation = generation

    async def _then_stop_pinging(self, content: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        try:
            async for chunk in content:
                yield chunk
            self.active = False  # the last chunk is written (we were resumed after it): pings stop here
        finally:
            await content.aclose()  # closed with us (client gone), so the relay's own `finally` runs now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TimeoutError:  # sse-starlette's send timeout: the client stopped reading
            log.warning("ended the stream of %s: its client read nothing for %g s", self.generation.stream.request_id,
                        self.send_timeout)
        finally:
            self.generation.abort_unless_finished()


class MsgpackStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse stops watching `http.disconnect` on ASGI ≥ 2.4 servers and then
    notices a vanished client only when a send fails — never while a request waits in the queue.
    This one always races the body against the disconnect, and aborts on every way out."""

    def __init__(self, generation: Generation, *args: Any, send_timeout_seconds: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generation = generation
        self.send_timeout_seconds = send_timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Any) -> None:
            with anyio.fail_after(self.send_timeout_seconds):
                await send(message)

        try:
            await run_until_disconnect(receive, lambda: self.stream_response(send_or_give_up))
        except* TimeoutError:  # raised inside run_until_disconnect's task group
            log.warning("ended the stream of %s: its client read nothing for %g s", self.generation.stream.request_id,
                        self.send_timeout_seconds)
        finally:
            self.generation.abort_unless_finished()
