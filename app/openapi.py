"""/openapi.json: an OpenAPI 3.1 description of the routes, with request bodies from the pydantic schemas."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from .responses_schemas import ResponsesRequest
from .schemas import REQUEST_MODELS

_POST_BODIES: dict[str, type[BaseModel]] = {**REQUEST_MODELS, "/v1/responses": ResponsesRequest}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
    }}},
}
_OBJECT = {"type": "object"}
_GENERATION_SUMMARIES = {
    "/v1/chat/completions": "Chat completion (OpenAI); `stream: true` answers with server-sent events",
    "/v1/completions": "Text completion (OpenAI legacy); `stream: true` answers with server-sent events",
    "/v1/responses": "Response (OpenAI's Responses API); `stream: true` answers with typed server-sent events, "
                     "`background: true` at once",
    "/tokenize": "Token ids of a prompt or of messages rendered with the chat template (vLLM)",
    "/detokenize": "Text of token ids (vLLM)",
}
_BODILESS_POSTS = {
    "/v1/cache/clear": "Forget every cached prefix: the KV pool's, host memory's and the disk's",
    "/v1/chat/completions/{id}/cancel": "End a chat stream's generation now",
    "/v1/completions/{id}/cancel": "End a completion stream's generation now",
}
_GETS = {
    "/v1/models": ("The served model (OpenAI)", "application/json"),
    "/health": ("200 once the model is loaded and warm, 503 before", "application/json"),
    "/metrics": ("Prometheus metrics", "text/plain"),
    "/openapi.json": ("This document", "application/json"),
    "/v1/chat/completions/{id}/stream": (("A chat stream's events after the Last-Event-ID header, then the live "
                                          "ones (a reconnect)"), "text/event-stream"),
    "/v1/completions/{id}/stream": ("A completion stream's events after Last-Event-ID, then the live ones",
                                    "text/event-stream"),
    "/v1/responses/{id}": ("A response as it stands; with stream=true&starting_after=N its events after N",
                           "application/json"),
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "error", "content": {"application/json": {"schema": _ERROR}}} for s in statuses}


@lru_cache(maxsize=4)
def openapi_schema(model_name: str) -> dict[str, Any]:
    keyed: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in _POST_BODIES.values()]
    refs, definitions = models_json_schema(keyed, ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    for path, model in _POST_BODIES.items():
        body_schema = refs[(model, "validation")]
        is_generation = path.startswith("/v1/")
        content = {"application/json": {"schema": _OBJECT}}
        if is_generation:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        paths[path] = {"post": {
            "summary": _GENERATION_SUMMARIES[path],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema},
                                                          "application/msgpack": {"schema": body_schema}}},
            "responses": {"200": {"description": "OK", "content": content},
                          **_errors(400, 401, 404, 413, *((429, 503) if is_generation else ()))},
        }}
    for path, summary in _BODILESS_POSTS.items():
        paths[path] = {"post": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": _OBJECT}}},
            **_errors(400, 401, 404, 503)}}}
    for path, (summary, media_type) in _GETS.items():
        paths[path] = {"get": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {media_type: {"schema": _OBJECT if "json" in media_type
                                                                  else {"type": "string"}}}},
            **({"503": {"description": "not ready", "content": {"application/json": {"schema": _OBJECT}}}}
               if path == "/health" else {}),
        }}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "treadle", "version": "0.1.0",
                 "description": f"OpenAI-compatible streaming generation with {model_name}."},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
