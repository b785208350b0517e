"""HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models; vLLM's /tokenize and
/detokenize; /v1/cache/clear; /health, /metrics and /openapi.json.

A generation request goes: admission (429 when full) → body → prompt ids → sampling parameters →
`engine.submit` → respond (streaming.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from decoding import TemplateError
from decoding.engine.errors import EngineShuttingDown

from .body import read_body
from .errors import APIError, encoded_response
from .openapi import openapi_schema
from .prompting import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    chat_prompt,
    checked_token_ids,
    encode_text,
    fim_prompt,
    sampling_params,
    scheduling_of,
    submit,
    tool_syntax,
    with_reasoning,
    with_tools,
)
from .protocol import ChatFormatter, CompletionFormatter, ResponseHeader
from .resuming import cancel_stream, resume_stream
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .server import ServingState, serving
from .streaming import respond

# The browser chat page (no build step), served at / unless --no-chat-page.
CHAT_PAGE = Path(__file__).resolve().parent.parent / "examples" / "chat.html"


async def chat_completions(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        body = await read_body(request, ChatCompletionRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        syntax = tool_syntax(state, body)
        prompt = await anyio.to_thread.run_sync(chat_prompt, state, body)
        params = sampling_params(engine, body, len(prompt.ids), DEFAULT_CHAT_MAX_TOKENS, "messages")
        params = with_reasoning(state, body, with_tools(state, body, params, syntax), prompt)
        header = ResponseHeader.new("chatcmpl", state.model_name, state.system_fingerprint)
        formatter = ChatFormatter(header, state.tokens, params.n, body.include_usage, syntax,
                                  is_reasoning=params.reasoning is not None)
        generation = submit(state, engine, prompt.ids, params, header.id, formatter,
                            scheduling_of(state, request, body))
    return await respond(request, generation, body.stream, state.stream_settings, state.runs)


async def completions(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        body = await read_body(request, CompletionRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        fim = None
        if body.suffix and isinstance(body.prompt, str):
            fim = await anyio.to_thread.run_sync(fim_prompt, state, body.prompt, body.suffix, "suffix")
            prompt_ids = fim.ids
        elif isinstance(body.prompt, str):
            prompt_ids = await anyio.to_thread.run_sync(encode_text, state, body.prompt, True, "prompt")
        else:
            prompt_ids = checked_token_ids(state, body.prompt, "prompt")  # before `echo` decodes them
        params = sampling_params(engine, body, len(prompt_ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        if fim is not None:
            params = replace(params, stop_token_ids=params.stop_token_ids + fim.stop_token_ids)
        echo_text = None
        if body.echo:
            echo_text = body.prompt if isinstance(body.prompt, str) else state.model.tokenizer.decode(prompt_ids)
        header = ResponseHeader.new("cmpl", state.model_name, state.system_fingerprint)
        formatter = CompletionFormatter(header, state.tokens, params.n, body.include_usage, prompt_ids, echo_text)
        generation = submit(state, engine, prompt_ids, params, header.id, formatter,
                            scheduling_of(state, request, body))
    return await respond(request, generation, body.stream, state.stream_settings, state.runs)


async def tokenize(request: Request) -> Response:
    state = serving(request)
    body = await read_body(request, TokenizeRequest, state.settings.max_body_bytes)
    state.check_model(body.model)
    # Off the event loop: a template may run for up to its render deadline, a long prompt takes a while.
    tokens = await anyio.to_thread.run_sync(_tokenize, state, body)
    return encoded_response(request, {"tokens": tokens, "count": len(tokens),
                                      "max_model_len": state.engine.max_model_len})


def _tokenize(state: ServingState, body: TokenizeRequest) -> list[int]:
    tokenizer = state.model.tokenizer
    if body.messages is not None:
        try:
            text = tokenizer.apply_chat_template([m.as_template_input() for m in body.messages],
                                                 add_generation_prompt=body.add_generation_prompt)
        except TemplateError as exc:
            raise APIError(400, f"the chat template cannot render these messages: {exc}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens is not False)


async def detokenize(request: Request) -> Response:
    state = serving(request)
    body = await read_body(request, DetokenizeRequest, state.settings.max_body_bytes)
    state.check_model(body.model)
    tokens = checked_token_ids(state, body.tokens, "tokens")
    text = await anyio.to_thread.run_sync(state.model.tokenizer.decode, tokens)  # up to a body's worth of ids
    return encoded_response(request, {"prompt": text})


async def models(request: Request) -> Response:
    state = serving(request)
    cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "treadle",
              "max_model_len": state.engine.max_model_len} for name in state.served_model_names]
    return encoded_response(request, {"object": "list", "data": cards})


async def health(request: Request) -> Response:
    state = serving(request)
    if state.engine.is_failed:  # nothing will be served any more: a supervisor should restart us
        return JSONResponse({"status": "failed"}, 503)
    if state.is_draining:
        return JSONResponse({"status": "draining"}, 503)
    if state.is_ready:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "failed" if state.startup_error else "loading"}, 503)


async def metrics(request: Request) -> Response:
    state = serving(request)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


async def clear_cache(request: Request) -> Response:
    """POST /v1/cache/clear: forget every cached prefix — the KV pool's, host memory's and the disk's
    (vLLM's /reset_prefix_cache). Running requests keep their KV; nothing new is shared with them."""
    state = serving(request)
    body = await request.body()
    if body.strip() not in (b"", b"{}"):
        raise APIError(400, "this endpoint takes no parameters: send no body or {}", code="invalid_request")
    if not state.is_ready or state.is_draining or state.engine.is_failed:
        raise APIError(503, "the server is not serving: there is no cache to clear now", code="unavailable")
    try:
        cleared = await anyio.to_thread.run_sync(state.engine.clear_prefix_cache)
    except EngineShuttingDown:
        raise APIError(503, "the server is shutting down", code="unavailable") from None
    return encoded_response(request, {"object": "cache.clear", "cleared_blocks": cleared})


async def chat_page(request: Request) -> Response:
    if not CHAT_PAGE.is_file():  # an install without the repository's examples/
        raise APIError(404, f"the chat page is not installed ({CHAT_PAGE} is missing)", code="not_found")
    return FileResponse(CHAT_PAGE, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema(serving(request).model_name))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/chat/completions/{id}/stream", resume_stream("chatcmpl-"), methods=["GET"]),
    Route("/v1/chat/completions/{id}/cancel", cancel_stream("chatcmpl-"), methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/completions/{id}/stream", resume_stream("cmpl-"), methods=["GET"]),
    Route("/v1/completions/{id}/cancel", cancel_stream("cmpl-"), methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/cache/clear", clear_cache, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
CHAT_PAGE_ROUTE = Route("/", chat_page, methods=["GET"])
