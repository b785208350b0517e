"""Errors in the shape of the API a route speaks: OpenAI's `{"error": {"message", "type", "param",
"code"}}` everywhere but Anthropic's Messages API (`{"type": "error", "error": {"type", "message"}}`)
and Ollama's API (`{"error": "..."}`), which get their own, chosen by the request's path."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"

RETRY_AFTER_SECONDS = "1"  # a queue slot frees when any request ends: usually within a second or two

# OpenAI's `type` values; clients branch on the HTTP status, humans read the message.
_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised anywhere in a route; answered as an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Anthropic's error types by status (docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                             503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip
ANTHROPIC_PREFIX, OLLAMA_PREFIX = "/v1/messages", "/api/"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPE_OF_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_for_path(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The error body in the shape of the API that `path` belongs to."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    return error_body(status, message, param, code)


def wants_msgpack(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return MSGPACK in accept or "application/x-msgpack" in accept


def encoded_response(request: Request, content: dict[str, Any], status: int = 200,
                     headers: dict[str, str] | None = None) -> Response:
    """JSON, or one msgpack map when the client sent `Accept: application/msgpack`."""
    if wants_msgpack(request):
        return Response(msgpack.packb(content), status, headers, media_type=MSGPACK)
    return JSONResponse(content, status, headers)


def invalid_body(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field (`messages.0.content`)."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    detail = first["msg"].removeprefix("Value error, ")
    message = detail if param is None else f"{param}: {detail}"
    return APIError(400, message, param=param, code="invalid_value")


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    body = error_for_path(request.url.path, exc.status, exc.message, exc.param, exc.code)
    return encoded_response(request, body, exc.status, exc.headers)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 and friends, in the same shape as ours."""
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    body = error_for_path(request.url.path, exc.status_code, message.get(exc.status_code, str(exc.detail)))
    return encoded_response(request, body, exc.status_code, dict(exc.headers or {}))


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """A bug, not bad input: the client gets no traceback (starlette re-raises it for the server's log)."""
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
    return encoded_response(request, error_for_path(request.url.path, 500, "internal server error"), 500)


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
