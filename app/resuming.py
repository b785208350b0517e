"""Resuming and cancelling a stream that outlives its connection (GET .../{id}/stream, POST .../{id}/cancel)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError, encoded_response
from .runs import EventsGone, Run
from .server import serving
from .streaming import SSE_FRAMING, Framing, stream_run


def run_of(request: Request, id_prefix: str) -> Run:
    """The stream named in the path, if this server still holds it (chat ids go to the chat route only)."""
    run_id = request.path_params["id"]
    run = serving(request).runs.get(run_id) if run_id.startswith(id_prefix) else None
    if run is None:
        raise APIError(404, f"no stream {run_id!r} here: it finished and was read to its end, its reconnect grace "
                            "period passed, or it was never streamed by this server", code="not_found")  # fmt: skip
    return run


def last_event_id(request: Request) -> int:
    """The number of the last event a reconnecting client saw: the Last-Event-ID header (EventSource and
    most SSE clients send it), or a `last_event_id` query parameter; -1 (from the start) without either."""
    value = request.headers.get("last-event-id", request.query_params.get("last_event_id"))
    if value is None or not value.strip():
        return -1
    try:
        return int(value.strip())
    except ValueError:
        raise APIError(400, f"Last-Event-ID must be an event number of this stream, got {value!r}",
                       "Last-Event-ID", code="invalid_value") from None


def resume_from(request: Request, run: Run, after: int, framing: Framing = SSE_FRAMING) -> Response:
    try:
        run.check_kept(after)
    except EventsGone as exc:
        raise APIError(410, f"{exc}: the stream cannot be resumed from there", code="events_expired") from None
    except ValueError as exc:
        raise APIError(400, str(exc), "Last-Event-ID", code="invalid_value") from None
    return stream_run(request, run, after, serving(request).stream_settings, framing)


def resume_stream(id_prefix: str) -> Callable[[Request], Awaitable[Response]]:
    """GET /v1/chat/completions/{id}/stream (and completions'): the events after Last-Event-ID, then the
    live ones: what a client that lost its connection missed, and the rest."""

    async def route(request: Request) -> Response:
        return resume_from(request, run_of(request, id_prefix), last_event_id(request))

    return route


def cancel_stream(id_prefix: str) -> Callable[[Request], Awaitable[Response]]:
    """POST /v1/chat/completions/{id}/cancel: end a stream's generation now (a stream outlives its
    connection for the reconnect grace period, so closing the connection alone stops it only then)."""

    async def route(request: Request) -> Response:
        run = run_of(request, id_prefix)
        run.abort_generation()
        return encoded_response(request, {"id": run.id, "object": "stream.cancel", "cancelled": not run.is_done})

    return route
