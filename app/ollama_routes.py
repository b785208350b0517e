"""Ollama's API: /api/chat and /api/generate (NDJSON streams by default, or one object with
`"stream": false`), /api/tags, /api/show, /api/ps and /api/version; errors as `{"error": "..."}`
(errors.py picks the shape by path). The routes that manage Ollama's model store answer what treadle
does instead (`treadle pull`, one model per server), never a 404 that looks like a missing server.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from dataclasses import replace
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .body import read_object, validated
from .errors import APIError, encoded_response
from .ollama_protocol import (
    ModelCard,
    OllamaChatRequest,
    OllamaFormatter,
    OllamaGenerateRequest,
    now_iso,
    ollama_named,
)
from .prompting import (
    DEFAULT_CHAT_MAX_TOKENS,
    chat_prompt,
    encode_text,
    fim_prompt,
    sampling_params,
    scheduling_of,
    submit,
    tool_syntax,
    with_reasoning,
    with_tools,
)
from .schemas import SchedulingFields
from .server import ServingState, serving
from .streaming import ndjson_run, new_run, respond
from .tool_syntaxes import syntax_for


def _model_name(state: ServingState, name: str | None) -> None:
    """Ollama's clients name models `name:tag`; `:latest` is the tag of a name without one."""
    if name is not None:
        state.check_model(name.removesuffix(":latest"))


@functools.lru_cache(maxsize=4)
def model_card(state: ServingState) -> ModelCard:
    model = state.model
    stat = model.path.stat()
    digest = hashlib.sha256(f"{model.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return ModelCard.of(model, state.model_name, state.engine.max_model_len, digest)


def _warning(ignored: list[str]) -> dict[str, str]:
    """RFC 7234's Warning header naming the options that changed nothing."""
    return {"Warning": f'199 treadle "options ignored: {", ".join(ignored)}"'} if ignored else {}


def _check_context(state: ServingState, num_ctx: int | None) -> None:
    if num_ctx is not None and num_ctx > state.engine.max_model_len:
        raise APIError(400, f"options.num_ctx {num_ctx} exceeds this server's context of {state.engine.max_model_len} "
                            "tokens (set by --max-model-len at start)", "options.num_ctx")  # fmt: skip


async def chat(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        data = await read_object(request, state.settings.max_body_bytes)
        body = validated(OllamaChatRequest, data)
        _model_name(state, body.model)
        ignored: list[str] = []
        chat_body = body.chat_request(state.reasoning is not None, ignored)
        _check_context(state, body.num_ctx)
        syntax = tool_syntax(state, chat_body)
        prompt = await anyio.to_thread.run_sync(chat_prompt, state, chat_body)
        try:
            params = sampling_params(engine, chat_body, len(prompt.ids), DEFAULT_CHAT_MAX_TOKENS, "messages")
            params = with_reasoning(state, chat_body, with_tools(state, chat_body, params, syntax), prompt)
        except APIError as exc:
            raise ollama_named(exc) from None
        formatter = OllamaFormatter(body.model, True, syntax)
        generation = submit(state, engine, prompt.ids, params, f"ollama-{id(formatter):x}", formatter,
                            scheduling_of(state, request, SchedulingFields()))
    return await _answer(request, state, generation, body.stream, ignored)


async def generate(request: Request) -> Response:
    state = serving(request)
    with state.admission() as engine:
        data = await read_object(request, state.settings.max_body_bytes)
        body = validated(OllamaGenerateRequest, data)
        _model_name(state, body.model)
        body.refuse_unsupported()
        if not body.prompt:  # Ollama's way of loading a model: treadle's is loaded
            return encoded_response(request, {"model": body.model, "created_at": now_iso(), "response": "",
                                              "done": True, "done_reason": "load"})  # fmt: skip
        ignored: list[str] = []
        _check_context(state, body.num_ctx)
        syntax = None
        try:
            if body.suffix:  # fill in the middle (Continue's autocomplete): the model's FIM tokens, no template
                completion = body.completion_request(ignored)
                fim = await anyio.to_thread.run_sync(fim_prompt, state, body.prompt, body.suffix, "suffix")
                ids = fim.ids
                params = sampling_params(engine, completion, len(ids), DEFAULT_CHAT_MAX_TOKENS, "prompt")
                params = replace(params, stop_token_ids=params.stop_token_ids + fim.stop_token_ids)
            elif body.raw:  # the prompt as it is, no template
                completion = body.completion_request(ignored)
                ids = await anyio.to_thread.run_sync(encode_text, state, body.prompt, True, "prompt")
                params = sampling_params(engine, completion, len(ids), DEFAULT_CHAT_MAX_TOKENS, "prompt")
            else:
                chat_body = body.chat_request(state.reasoning is not None, ignored)
                prompt = await anyio.to_thread.run_sync(chat_prompt, state, chat_body)
                ids = prompt.ids
                params = sampling_params(engine, chat_body, len(ids), DEFAULT_CHAT_MAX_TOKENS, "prompt")
                params = with_reasoning(state, chat_body, params, prompt)
        except APIError as exc:
            raise ollama_named(exc) from None
        formatter = OllamaFormatter(body.model, False, syntax)
        generation = submit(state, engine, ids, params, f"ollama-{id(formatter):x}", formatter,
                            scheduling_of(state, request, SchedulingFields()))
    return await _answer(request, state, generation, body.stream, ignored)


async def _answer(request: Request, state: ServingState, generation: Any, stream: bool, ignored: list[str]) -> Response:
    if stream:
        response = ndjson_run(state.runs.add(new_run(generation, state.stream_settings)), state.stream_settings)
    else:
        response = await respond(request, generation, False, state.stream_settings, state.runs)
    response.headers.update(_warning(ignored))
    return response


async def tags(request: Request) -> Response:
    state = serving(request)
    return encoded_response(request, {"models": [model_card(state).listing()]})


async def ps(request: Request) -> Response:
    state = serving(request)
    card = model_card(state)
    loaded = {**card.listing(), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
              "context_length": card.context_length}  # loaded until the server stops  # fmt: skip
    return encoded_response(request, {"models": [loaded]})


async def show(request: Request) -> Response:
    state = serving(request)
    data = await read_object(request, state.settings.max_body_bytes)
    name = data.get("model", data.get("name"))
    if not isinstance(name, str) or not name:
        raise APIError(400, "model is required", "model")
    _model_name(state, name)
    card, config = model_card(state), state.model.config
    template = state.model.tokenizer.chat_template_source or ""
    arch = config.architecture
    capabilities = ["completion"]
    if syntax_for(template, state.settings.tool_call_parser) is not None:
        capabilities.append("tools")
    if state.reasoning is not None:
        capabilities.append("thinking")
    info = {"general.architecture": arch, "general.parameter_count": card.parameter_count,
            f"{arch}.context_length": card.context_length, f"{arch}.embedding_length": config.dim,
            f"{arch}.block_count": config.n_layers, f"{arch}.attention.head_count": config.n_heads,
            f"{arch}.attention.head_count_kv": config.n_kv_heads, f"{arch}.feed_forward_length": config.hidden_dim}
    return encoded_response(request, {"license": "", "modelfile": "", "parameters": "", "template": template,
                                      "details": card.details(), "model_info": info, "capabilities": capabilities,
                                      "modified_at": card.modified_at})  # fmt: skip


async def version(request: Request) -> Response:
    try:
        number = importlib.metadata.version("treadle")
    except importlib.metadata.PackageNotFoundError:
        number = "0.0.0"
    return encoded_response(request, {"version": number})


def _not_here(what: str) -> Any:
    async def route(request: Request) -> Response:
        raise APIError(501, f"{what}: treadle serves the one model it was started with (--model); download models "
                            "with `treadle pull NAME` and start `treadle serve --model NAME`", code="not_supported")
    return route


OLLAMA_ROUTES = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
    Route("/api/pull", _not_here("models are not pulled through the API"), methods=["POST"]),
    Route("/api/push", _not_here("models are not pushed from treadle"), methods=["POST"]),
    Route("/api/create", _not_here("models are not created through the API"), methods=["POST"]),
    Route("/api/copy", _not_here("models are not copied through the API"), methods=["POST"]),
    Route("/api/delete", _not_here("models are not deleted through the API"), methods=["DELETE"]),
]
