"""Request bodies: read under a size limit, decode JSON or msgpack, validate into a schema."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from .errors import APIError, invalid_body

Body = TypeVar("Body", bound=BaseModel)

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


async def read_body(request: Request, schema: type[Body], max_bytes: int) -> Body:
    return validated(schema, await read_object(request, max_bytes))


async def read_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON (or msgpack) object, not yet validated."""
    raw = await _read_limited(request, max_bytes)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    # Anything that is not msgpack is read as JSON, so `curl -d '{...}'` without a Content-Type works.
    data = _decode_msgpack(raw) if content_type in MSGPACK_TYPES else _decode_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be an object", code="invalid_body")
    return data


def validated(schema: type[Body], data: dict[str, Any]) -> Body:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise invalid_body(exc) from None


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be too large (before buffering it all)."""
    too_large = APIError(413, f"the request body exceeds {max_bytes} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_json(raw: bytes) -> Any:
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if _has_lone_surrogate(data):
        # JSON can escape half a UTF-16 pair ("\ud800"); such a string cannot be encoded or tokenized.
        raise APIError(400, "the request body holds a string with an unpaired UTF-16 surrogate", code="invalid_json")
    return data


def _decode_msgpack(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # ExtraData, StackError, bad UTF-8
        raise APIError(400, f"the request body is not valid msgpack: {exc}", code="invalid_msgpack") from None


def _has_lone_surrogate(data: Any) -> bool:
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
