"""The Responses API's routes: POST /v1/responses (streamed, whole or in the background), GET
/v1/responses/{id} (its state, or its events after `starting_after` with `stream=true`), POST
/v1/responses/{id}/cancel, DELETE /v1/responses/{id}; and the in-memory store they share.

Every response runs as a run (runs.py), so its events are numbered (`sequence_number`) and kept while
it runs and for the stream grace period after: a client that lost its stream reads on from the last
event it saw. A background response belongs to no connection; any other is aborted when its last
reader has been gone for the grace period, as chat streams are.
"""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .body import read_body
from .errors import APIError, encoded_response
from .outcomes import error_for
from .prompting import (
    DEFAULT_CHAT_MAX_TOKENS,
    chat_prompt,
    sampling_params,
    scheduling_of,
    submit,
    tool_syntax,
    with_reasoning,
    with_tools,
)
from .response_store import StoredResponse
from .responses_protocol import ResponsesFormatter, ResponseState
from .responses_schemas import ResponsesRequest, new_id
from .resuming import last_event_id, resume_from
from .runs import Run
from .server import serving
from .streaming import TYPED_SSE_FRAMING, new_run, run_until_disconnect, stream_run


async def create_response(request: Request) -> Response:
    state = serving(request)
    store = state.responses
    with state.admission() as engine:
        body = await read_body(request, ResponsesRequest, state.settings.max_body_bytes)
        state.check_model(body.model)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous response {body.previous_response_id!r} not found (it was not "
                                    "stored, or it expired)", "previous_response_id", code="not_found")  # fmt: skip
            if not previous.state.is_finished or not previous.state.conversation:
                raise APIError(400, f"previous response {body.previous_response_id!r} has not completed",
                               "previous_response_id")  # fmt: skip
            history = previous.state.conversation
        chat = body.chat_request(history)
        syntax = tool_syntax(state, chat)
        prompt = await anyio.to_thread.run_sync(chat_prompt, state, chat)
        params = sampling_params(engine, chat, len(prompt.ids), DEFAULT_CHAT_MAX_TOKENS, "input")
        try:
            params = with_reasoning(state, chat, with_tools(state, chat, params, syntax), prompt)
        except APIError as exc:  # named after the Responses field
            param = "reasoning.effort" if exc.param == "reasoning_effort" else exc.param
            raise APIError(exc.status, exc.message.replace("reasoning_effort", "reasoning.effort"), param,
                           exc.code) from None
        response_state = ResponseState(body, new_id("resp"), state.model_name)
        response_state.history = history
        formatter = ResponsesFormatter(response_state, syntax)
        generation = submit(state, engine, prompt.ids, params, response_state.id, formatter,
                             scheduling_of(state, request, body))
    run = new_run(generation, state.stream_settings, is_background=body.background)
    stored = StoredResponse(response_state, run)
    store.add(stored)
    if body.stream:
        return stream_run(request, run, -1, state.stream_settings, TYPED_SSE_FRAMING)
    if body.background:
        return encoded_response(request, response_state.as_dict())
    run.attach()  # the connection waits for it; if the client leaves, the run is aborted as a stream's is
    try:
        is_complete = await run_until_disconnect(request.receive, lambda: _until_done(run))
    finally:
        run.detach(read_to_the_end=True)
    if not is_complete:
        run.abort_generation()
        return Response(status_code=499)
    if response_state.failure is not None and response_state.error is not None:
        raise error_for(response_state.failure, response_state.error["message"])
    return encoded_response(request, response_state.as_dict())


async def _until_done(run: Run) -> None:
    async for _ in run.follow():
        pass


def _stored(request: Request) -> StoredResponse:
    response_id = request.path_params["id"]
    stored = serving(request).responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no response {response_id!r} here (not stored, expired, or deleted)", code="not_found")
    return stored


async def retrieve_response(request: Request) -> Response:
    stored = _stored(request)
    stream = request.query_params.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise APIError(400, f"stream must be true or false, got {stream!r}", "stream")
    if stream == "false":
        return encoded_response(request, stored.state.as_dict())
    if stored.run is None:
        raise APIError(410, "this response's events are no longer kept: retrieve it without stream",
                       code="events_expired")  # fmt: skip
    starting_after = request.query_params.get("starting_after")
    if starting_after is None:
        after = last_event_id(request)
    else:
        try:
            after = int(starting_after)
        except ValueError:
            raise APIError(400, f"starting_after must be a sequence number, got {starting_after!r}",
                           "starting_after") from None
    return resume_from(request, stored.run, after, TYPED_SSE_FRAMING)


async def cancel_response(request: Request) -> Response:
    stored = _stored(request)
    if not stored.state.body.background:
        raise APIError(400, "only responses created with background: true can be cancelled")
    if not stored.state.is_finished and stored.run is not None:
        stored.run.abort_generation()
        await _until_done(stored.run)  # its last events record the cancellation
    return encoded_response(request, stored.state.as_dict())


async def delete_response(request: Request) -> Response:
    stored = _stored(request)
    serving(request).responses.delete(stored.state.id)
    if stored.run is not None:
        stored.run.abort_generation()
    return encoded_response(request, {"id": stored.state.id, "object": "response.deleted", "deleted": True})


RESPONSES_ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{id}/cancel", cancel_response, methods=["POST"]),
]
