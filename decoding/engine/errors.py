"""Why the engine refuses a request: each maps to one HTTP status in app/routes.py."""

from __future__ import annotations


class QueueFull(RuntimeError):
    """Running plus waiting requests reached `max_queue`: try again later (HTTP 429)."""


class EngineShuttingDown(RuntimeError):
    """The engine stopped admitting requests (HTTP 503)."""


class EngineFailed(RuntimeError):
    """The engine thread ended on an error it could not contain: nothing more is served (HTTP 503)."""


class RequestTooLarge(ValueError):
    """The request can never be served: longer than the context, or larger than the whole KV cache."""
