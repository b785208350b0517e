"""HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models; vLLM's /tokenize and
/detokenize; /health, /metrics and /openapi.json.

A generation request goes: admission (429 when full) → body → prompt ids → sampling parameters →
`engine.submit` → respond (streaming.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from decoding import TemplateError
from decoding.engine.engine import Engine, EngineFailed, EngineShuttingDown, QueueFull, RequestTooLarge
from decoding.engine.params import InvalidParams, SamplingParams

from .body import read_body
from .errors import APIError, encoded_response
from .metrics import TokenGapTimer
from .openapi import openapi_schema
from .protocol import ChatFormatter, CompletionFormatter, ResponseHeader
from .runs import EventsGone, Formatter, Generation, Run
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SchedulingFields,
    TokenizeRequest,
)
from .server import ServingState, serving
from .streaming import SSE_FRAMING, Framing, respond, stream_run
from .tools import HermesToolCalls, syntax_for

# Without max_tokens, chat may use the rest of the context (as vLLM), capped so that a forgotten
# limit cannot hold a sequence for minutes; completions keep OpenAI's documented default of 16.
DEFAULT_CHAT_MAX_TOKENS = 4096
DEFAULT_COMPLETION_MAX_TOKENS = 16

# The browser chat page (no build step), served at / unless --no-chat-page.
CHAT_PAGE = Path(__file__).resolve().parent.parent / "examples" / "chat.html"


async def chat_completions(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        body = await read_body(request, ChatCompletionRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        syntax = tool_syntax(state, body)
        prompt_ids = await anyio.to_thread.run_sync(chat_prompt_ids, state, body)
        params = sampling_params(engine, body, len(prompt_ids), DEFAULT_CHAT_MAX_TOKENS, "messages")
        params = with_tools(state, body, params, syntax)
        header = ResponseHeader.new("chatcmpl", state.model_name, state.system_fingerprint)
        formatter = ChatFormatter(header, state.tokens, params.n, body.include_usage, syntax)
        generation = submit(state, engine, prompt_ids, params, header.id, formatter,
                            scheduling_of(state, request, body))
    return await respond(request, generation, body.stream, state.stream_settings, state.runs)


async def completions(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        body = await read_body(request, CompletionRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await anyio.to_thread.run_sync(_encode, state, body.prompt, True, "prompt")
        else:
            prompt_ids = _checked_token_ids(state, body.prompt, "prompt")  # before `echo` decodes them
        params = sampling_params(engine, body, len(prompt_ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        echo_text = None
        if body.echo:
            echo_text = body.prompt if isinstance(body.prompt, str) else state.model.tokenizer.decode(prompt_ids)
        header = ResponseHeader.new("cmpl", state.model_name, state.system_fingerprint)
        formatter = CompletionFormatter(header, state.tokens, params.n, body.include_usage, prompt_ids, echo_text)
        generation = submit(state, engine, prompt_ids, params, header.id, formatter,
                            scheduling_of(state, request, body))
    return await respond(request, generation, body.stream, state.stream_settings, state.runs)


def tool_syntax(state: ServingState, body: ChatCompletionRequest) -> HermesToolCalls | None:
    """The model's tool-call syntax when the request calls tools; a 400 if treadle cannot read it."""
    if not body.calls_tools:
        return None
    tokenizer = state.model.tokenizer
    syntax = syntax_for(tokenizer.chat_template_source)
    if syntax is None:
        reason = "has no chat template" if not tokenizer.has_chat_template else \
            "has a chat template without a tool-call syntax treadle reads (Hermes-style <tool_call>)"  # fmt: skip
        raise APIError(400, f"tools cannot be used with this model: it {reason}", "tools")
    return syntax


def with_tools(state: ServingState, body: ChatCompletionRequest, params: SamplingParams,
               syntax: HermesToolCalls | None) -> SamplingParams:
    """The sampling parameters of a request that calls tools: a forced call's grammar, or (auto) the
    trigger that gives a call the model begins valid arguments."""
    if syntax is None:
        return params
    tag_ids = {tag: ids[0] if len(ids := state.model.tokenizer.encode(tag)) == 1 else None
               for tag in (syntax.start, syntax.end)}  # fmt: skip
    if body.forces_a_call:
        if params.constraint is not None:
            raise APIError(400, f"tool_choice {body.tool_choice!r} and {params.constraint.field} both "
                                "constrain the output: give one", "tool_choice")  # fmt: skip
        parallel = body.parallel_tool_calls and body.tool_choice == "required"  # a named function: one call
        params = replace(params, constraint=syntax.constraint(body.called_functions(), parallel, tag_ids))
    elif params.constraint is None:  # auto: a call the model begins gets valid arguments
        params = replace(params, call_trigger=syntax.call_trigger(body.called_functions(), tag_ids))
    # the tags may be special tokens: the parser must see them in the text
    return replace(params, skip_special_tokens=False)


def chat_prompt_ids(state: ServingState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.model.tokenizer
    extra = {"tools": body.tools_for_template()} if body.calls_tools else {}
    try:
        text = tokenizer.apply_chat_template(body.template_input(), True, **extra)
    except TemplateError as exc:
        raise APIError(400, f"the chat template cannot render these messages: {exc}", "messages") from None
    missing = [t["function"]["name"] for t in extra.get("tools", []) if t["function"]["name"] not in text]
    if missing:  # a template that ignores `tools` would leave the model blind to them
        raise APIError(400, f"this model's chat template does not render tools ({missing[0]!r} is not in the "
                            "prompt)", "tools")  # fmt: skip
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens it wants
    if not ids:
        raise APIError(400, "messages is empty", "messages", code="empty_prompt")
    return ids


def _checked_token_ids(state: ServingState, token_ids: list[int], param: str) -> list[int]:
    """Token ids from the client, within the vocabulary (the tokenizer overflows on ids past 32 bits)."""
    vocab_size = state.model.config.vocab_size
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise APIError(400, f"token ids must lie in [0, {vocab_size})", param, code="invalid_value")
    return token_ids


def _encode(state: ServingState, text: str, add_special_tokens: bool, param: str) -> list[int]:
    ids = state.model.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise APIError(400, f"{param} is empty", param, code="empty_prompt")
    return ids


def sampling_params(engine: Engine, body: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int,
                     default_max_tokens: int, prompt_param: str) -> SamplingParams:
    max_tokens = _max_tokens(engine, num_prompt_tokens, body.requested_max_tokens, default_max_tokens, prompt_param)
    try:
        return body.sampling_params(max_tokens)
    except InvalidParams as exc:
        param = "logprobs" if exc.param == "prompt_logprobs" else exc.param
        raise APIError(400, str(exc), param, code="invalid_value") from None


def _max_tokens(engine: Engine, num_prompt_tokens: int, requested: int | None, default: int, prompt_param: str) -> int:
    """Check the prompt and max_tokens against the context here, where the field can be named."""
    context = engine.max_model_len
    remaining = context - num_prompt_tokens
    if remaining < 1:
        raise APIError(400, f"the prompt has {num_prompt_tokens} tokens; the context holds {context}",
                       prompt_param, code="context_length_exceeded")
    if requested is None:
        # Also within what the whole KV cache can hold, so the default never makes a request unservable.
        kv_tokens = engine.kv.num_total_blocks * engine.config.block_size
        return max(1, min(remaining, kv_tokens - num_prompt_tokens, default))
    if requested > remaining:
        raise APIError(400, f"max_tokens ({requested}) + the prompt ({num_prompt_tokens} tokens) exceed the context "
                            f"of {context} tokens", "max_tokens", code="context_length_exceeded")
    return requested


@dataclass(frozen=True, slots=True)
class Scheduling:
    priority: int = 0
    queue_timeout: float | None = None


def scheduling_of(state: ServingState, request: Request, body: SchedulingFields) -> Scheduling:
    """The body's `priority` (else --priority-header's value) and `timeout` (else --queue-timeout-seconds)."""
    priority = body.priority
    header = state.settings.priority_header
    if "priority" not in body.model_fields_set and header and (value := request.headers.get(header)) is not None:
        try:
            priority = int(value.strip())
        except ValueError:
            raise APIError(400, f"the {header} header must be an integer priority, got {value!r}", header,
                           code="invalid_value") from None
        if not -(2**31) <= priority < 2**31:
            raise APIError(400, f"the {header} header is out of range", header, code="invalid_value")
    timeout = body.timeout if body.timeout is not None else state.settings.queue_timeout_seconds
    return Scheduling(priority, timeout)


def submit(state: ServingState, engine: Engine, prompt_ids: list[int], params: SamplingParams, request_id: str,
            formatter: Formatter, scheduling: Scheduling) -> Generation:
    try:
        stream = engine.submit(prompt_ids, params, request_id, loop=asyncio.get_running_loop(),
                               priority=scheduling.priority, queue_timeout=scheduling.queue_timeout)
    except QueueFull:
        raise state.queue_full() from None
    except RequestTooLarge as exc:
        raise APIError(400, str(exc), code="context_length_exceeded") from None
    except InvalidParams as exc:
        raise APIError(400, str(exc), exc.param, code="invalid_value") from None
    except EngineShuttingDown as exc:
        raise APIError(503, str(exc), code="shutting_down") from None
    except EngineFailed as exc:
        raise APIError(503, str(exc), code="engine_failed") from None
    return Generation(engine, stream, formatter, TokenGapTimer(state.metrics.inter_token_latency))


def _run_of(request: Request, id_prefix: str) -> Run:
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
        return resume_from(request, _run_of(request, id_prefix), last_event_id(request))

    return route


def cancel_stream(id_prefix: str) -> Callable[[Request], Awaitable[Response]]:
    """POST /v1/chat/completions/{id}/cancel: end a stream's generation now (a stream outlives its
    connection for the reconnect grace period, so closing the connection alone stops it only then)."""

    async def route(request: Request) -> Response:
        run = _run_of(request, id_prefix)
        run.abort_generation()
        return encoded_response(request, {"id": run.id, "object": "stream.cancel", "cancelled": not run.is_done})

    return route


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
    tokens = _checked_token_ids(state, body.tokens, "tokens")
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
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
CHAT_PAGE_ROUTE = Route("/", chat_page, methods=["GET"])
