"""Anthropic's Messages API: POST /v1/messages (whole, or streamed as typed SSE events) and POST
/v1/messages/count_tokens. Errors are in Anthropic's shape (errors.py picks it by path); `x-api-key` is
taken beside the bearer scheme, and the `anthropic-version` and `anthropic-beta` headers are accepted.
"""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .anthropic_protocol import MessagesFormatter, MessagesRequest, anthropic_named, new_id
from .body import read_body, read_object, validated
from .errors import APIError, encoded_response
from .prompting import (
    chat_prompt,
    sampling_params,
    scheduling_of,
    submit,
    tool_syntax,
    with_reasoning,
    with_tools,
)
from .server import serving
from .streaming import TYPED_SSE_FRAMING, new_run, respond, stream_run


async def create_message(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        body = await read_body(request, MessagesRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        chat = body.chat_request(thinking_model=state.reasoning is not None)
        syntax = tool_syntax(state, chat)
        prompt = await anyio.to_thread.run_sync(chat_prompt, state, chat)
        params = sampling_params(engine, chat, len(prompt.ids), body.max_tokens, "messages")
        try:
            params = with_reasoning(state, chat, with_tools(state, chat, params, syntax), prompt)
        except APIError as exc:
            raise anthropic_named(exc) from None
        omit = body.thinking is not None and body.thinking.display == "omitted"
        formatter = MessagesFormatter(new_id("msg"), state.model_name, len(prompt.ids), syntax, omit_thinking=omit)
        generation = submit(state, engine, prompt.ids, params, formatter.id, formatter,
                            scheduling_of(state, request, body))
    if not body.stream:
        return await respond(request, generation, False, state.stream_settings, state.runs)
    run = state.runs.add(new_run(generation, state.stream_settings))
    return stream_run(request, run, -1, state.stream_settings, TYPED_SSE_FRAMING)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the template renders the conversation, its tools and system included."""
    state = serving(request)
    data = await read_object(request, state.settings.max_body_bytes)
    body = validated(MessagesRequest, {**data, "max_tokens": 1})  # it takes no max_tokens; the schema wants one
    state.check_model(body.model)
    chat = body.chat_request(thinking_model=state.reasoning is not None)
    tool_syntax(state, chat)  # tools the model cannot call are a 400 here too
    prompt = await anyio.to_thread.run_sync(chat_prompt, state, chat)
    return encoded_response(request, {"input_tokens": len(prompt.ids)})


ANTHROPIC_ROUTES = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
