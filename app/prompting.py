"""From an API request to the engine: prompt token ids, sampling parameters, tools, scheduling, submission.

Every generating route (chat, completions, responses, and the other APIs' translations) builds its
request here, so that a prompt, a limit or a refusal reads the same whatever the API.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request

from decoding import TemplateError
from decoding.engine.engine import Engine, EngineFailed, EngineShuttingDown, QueueFull, RequestTooLarge
from decoding.engine.params import InvalidParams, SamplingParams

from .errors import APIError
from .metrics import TokenGapTimer
from .reasoning import template_reads, thinking_budget
from .runs import Formatter, Generation
from .schemas import ChatCompletionRequest, CompletionRequest, SchedulingFields
from .server import ServingState
from .tool_syntaxes import syntax_for
from .tools import ToolSyntax

# Without max_tokens, chat may use the rest of the context (as vLLM), capped so that a forgotten
# limit cannot hold a sequence for minutes; completions keep OpenAI's documented default of 16.
DEFAULT_CHAT_MAX_TOKENS = 4096
DEFAULT_COMPLETION_MAX_TOKENS = 16

def tool_syntax(state: ServingState, body: ChatCompletionRequest) -> ToolSyntax | None:
    """The model's tool-call syntax when the request calls tools; a 400 if treadle cannot read it."""
    if not body.calls_tools:
        return None
    tokenizer = state.model.tokenizer
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    syntax = syntax_for(tokenizer.chat_template_source, state.settings.tool_call_parser, functions)
    if syntax is None:
        reason = "has no chat template" if not tokenizer.has_chat_template else \
            ("has a chat template without a tool-call syntax treadle reads (Hermes <tool_call>, Llama 3 JSON, "
             "Mistral [TOOL_CALLS], Qwen3-Coder <function=...>; --tool-call-parser names one)")  # fmt: skip
        raise APIError(400, f"tools cannot be used with this model: it {reason}", "tools")
    return syntax


def with_tools(state: ServingState, body: ChatCompletionRequest, params: SamplingParams,
               syntax: ToolSyntax | None) -> SamplingParams:
    """The sampling parameters of a request that calls tools: a forced call's grammar, or (auto) the
    trigger that gives a call the model begins valid arguments."""
    if syntax is None:
        return params
    tag_ids = {tag: ids[0] if len(ids := state.model.tokenizer.encode(tag)) == 1 else None
               for tag in syntax.tags}  # fmt: skip
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


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    ids: list[int]
    text: str  # as the template rendered it: where it leaves a thinking model (opened or closed its thinking)


def template_variables(state: ServingState, body: ChatCompletionRequest) -> dict[str, Any]:
    """What the template gets beside the messages: the server's and the request's chat_template_kwargs,
    `reasoning_effort` where the template reads it (or `enable_thinking: false` for "none" where it reads
    that instead), and the tools."""
    tokenizer = state.model.tokenizer
    defaults = state.settings.default_chat_template_kwargs
    variables: dict[str, Any] = {**(json.loads(defaults) if defaults else {}), **(body.chat_template_kwargs or {})}
    effort = body.reasoning_effort
    if effort is not None and template_reads(tokenizer, "reasoning_effort"):
        variables.setdefault("reasoning_effort", effort)
    elif effort == "none" and template_reads(tokenizer, "enable_thinking"):
        variables.setdefault("enable_thinking", False)
    if body.calls_tools:
        variables["tools"] = body.tools_for_template()
    return variables


def chat_prompt(state: ServingState, body: ChatCompletionRequest) -> ChatPrompt:
    tokenizer = state.model.tokenizer
    extra = template_variables(state, body)
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
    return ChatPrompt(ids, text)


def with_reasoning(state: ServingState, body: ChatCompletionRequest, params: SamplingParams,
                   prompt: ChatPrompt) -> SamplingParams:  # fmt: skip
    """A thinking model's request: its markers, the phase its prompt leaves it in, and its budget."""
    budget = thinking_budget(state.reasoning, state.model.tokenizer, body.thinking_token_budget,
                             body.reasoning_effort, state.settings.default_thinking_budget)  # fmt: skip
    if state.reasoning is None:
        return params
    return replace(params, reasoning=state.reasoning.params(prompt.text, budget))


# Fill-in-the-middle: the spellings of the three tokens of code models trained for it (Qwen2.5-Coder's,
# StarCoder's), in prefix-suffix-middle order; and the tokens that end a middle (or begin something else).
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
FIM_ENDS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>", "<|fim_suffix|>",
            "<|fim_middle|>", "<fim_pad>", "<file_sep>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>")


@dataclass(frozen=True, slots=True)
class FimPrompt:
    ids: list[int]
    stop_token_ids: tuple[int, ...]  # what ends the middle, beside the model's EOS


def fim_prompt(state: ServingState, prefix: str, suffix: str, param: str) -> FimPrompt:
    """The prompt that asks a code model for the text between `prefix` and `suffix`, or a 400 naming
    `param` where the model was not trained to fill in the middle."""
    tokenizer = state.model.tokenizer

    def single(text: str) -> int | None:
        ids = tokenizer.encode(text)
        return ids[0] if len(ids) == 1 and tokenizer.is_special(ids[0]) else None

    for spelling in FIM_TOKENS:
        begin, hole, middle = (single(t) for t in spelling)
        if begin is not None and hole is not None and middle is not None:
            ids = [begin, *tokenizer.encode(prefix), hole, *tokenizer.encode(suffix), middle]
            ends = tuple(dict.fromkeys(i for t in FIM_ENDS if (i := single(t)) is not None))
            return FimPrompt(ids, ends)
    raise APIError(400, f"{param} needs a model trained to fill in the middle: this model's vocabulary has no "
                        "<|fim_prefix|>, <|fim_suffix|> and <|fim_middle|> tokens", param,
                   code="unsupported_parameter")  # fmt: skip


def checked_token_ids(state: ServingState, token_ids: list[int], param: str) -> list[int]:
    """Token ids from the client, within the vocabulary (the tokenizer overflows on ids past 32 bits)."""
    vocab_size = state.model.config.vocab_size
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise APIError(400, f"token ids must lie in [0, {vocab_size})", param, code="invalid_value")
    return token_ids


def encode_text(state: ServingState, text: str, add_special_tokens: bool, param: str) -> list[int]:
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
    route: str = ""  # the path the request came to (its metrics' label)


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
    return Scheduling(priority, timeout, request.url.path)


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
    if scheduling.route:
        state.metrics.requests_by_route.labels(scheduling.route).inc()
    return Generation(engine, stream, formatter, TokenGapTimer(state.metrics.inter_token_latency))
