"""Anthropic's Messages API: the request body, its translation into the chat pipeline's request, and
the message with the typed events that stream it.

A Messages request is answered by the chat machinery (template, tools with enforced `tool_choice`,
reasoning, sampling): `MessagesRequest.chat_request()` writes the equivalent chat request, as the
Responses API does. What comes back is formatted here: `MessagesFormatter` turns engine outputs into
Anthropic's stream (`message_start`, a `ping`, per content block `content_block_start`, its deltas —
`thinking_delta`, `text_delta`, `input_json_delta` — and `content_block_stop`, then `message_delta`
with the stop reason and usage, and `message_stop`) or into one whole message.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from decoding.engine.outputs import FinishReason, RequestOutput, Usage

from .errors import APIError, anthropic_error_body, invalid_body
from .outcomes import failure_message, is_failure, outcome_of
from .protocol import Chunk, merge_outputs, request_usage
from .schema_base import NonEmptyStr, StrictBody, one_of, refuse_not_implemented
from .schemas import ChatCompletionRequest, SchedulingFields
from .tools import ToolSyntax, split_calls

# Fields that would change the output and are not implemented, with the values that change nothing.
MESSAGES_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "mcp_servers": (None, []),
    "container": (None,),
    "context_management": (None,),
}
# output_config.effort → the chat request's reasoning_effort
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
BLOCK_TYPES = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: Annotated[str | list[TextBlock], one_of("must be a string or a list of text blocks")] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(StrictBody):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictBody):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class AnthropicMessage(StrictBody):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class AnthropicTool(StrictBody):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type tool, and only with it")
        return self


class ThinkingConfig(StrictBody):
    """`enabled` with a budget; `adaptive` and `between_tools`: the model thinks as it will (no budget);
    `disabled`. `display: omitted` sends thinking blocks without their text."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required with type enabled")
        return self


class JsonOutputFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictBody):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class MessagesRequest(SchedulingFields):
    model: NonEmptyStr
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: Annotated[str | list[TextBlock], one_of("must be a string or a list of text blocks")] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # structured output (format) and effort
    # the caller's, or about billing and routing: change nothing here (the prefix cache needs no cache_control)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        refuse_not_implemented(data, MESSAGES_NOT_IMPLEMENTED)
        for i, tool in enumerate(data.get("tools") or [] if isinstance(data.get("tools"), list) else []):
            if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: only client tools with an "
                                    "input_schema (treadle runs no server tools)", f"tools.{i}.type",
                               code="unsupported_parameter")  # fmt: skip
        messages = data.get("messages")
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            allowed = BLOCK_TYPES.get(message.get("role"), ()) if isinstance(message, dict) else ()
            for j, block in enumerate(content if isinstance(content, list) else []):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in allowed:
                    what = "image" if kind == "image" else repr(kind)
                    raise APIError(400, f"{what} content blocks are not supported in a {message.get('role')} "
                                        f"message (treadle serves text models: {', '.join(allowed)})",
                                   f"messages.{i}.content.{j}.type", code="unsupported_parameter")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _no_prefill(self) -> MessagesRequest:
        if self.messages[-1].role == "assistant":
            raise APIError(400, "a final assistant message (prefilling the answer) is not supported: end with a user "
                                "message", "messages", code="unsupported_parameter")  # fmt: skip
        names = [t.name for t in self.tools or []]
        if self.tool_choice is not None and self.tool_choice.type == "tool" and self.tool_choice.name not in names:
            raise APIError(400, f"tool_choice names {self.tool_choice.name!r}, which is not in tools", "tool_choice")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: tool results become tool messages, tool_use blocks an
        assistant's tool_calls, thinking blocks its reasoning_content (redacted thinking is dropped)."""
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "\n".join(b.text for b in self.system)  # fmt: skip
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            blocks = message.blocks()
            text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
            if message.role == "user":
                messages += [{"role": "tool", "tool_call_id": b.tool_use_id,
                              "content": ("(error) " if b.is_error else "") + b.text()}
                             for b in blocks if isinstance(b, ToolResultBlock)]  # fmt: skip
                if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    messages.append({"role": "user", "content": text})
                continue
            answer: dict[str, Any] = {"role": "assistant", "content": text or None}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]  # fmt: skip
            if calls:
                answer["tool_calls"] = calls
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thinking:
                answer["reasoning_content"] = thinking
            messages.append(answer)
        return messages

    def chat_request(self, thinking_model: bool) -> ChatCompletionRequest:
        """The chat request that answers this one. `thinking_model`: the server runs a reasoning parser.
        Elsewhere `thinking` and `output_config.effort` are kept trivially — a model that does not
        think stays within any budget — so a client that always sends them (Claude Code) is served."""
        body: dict[str, Any] = {
            "messages": self.chat_messages(), "max_tokens": self.max_tokens, "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences,
            "priority": self.priority, "timeout": self.timeout,
        }
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               "description": t.description}}
                             for t in self.tools]  # fmt: skip
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type == "enabled" and thinking_model:
            body["thinking_token_budget"] = self.thinking.budget_tokens
        elif self.thinking is not None and self.thinking.type == "disabled" and thinking_model:
            body["reasoning_effort"] = "none"
        config = self.output_config
        if config is not None and config.effort is not None and "reasoning_effort" not in body and thinking_model:
            body["reasoning_effort"] = EFFORTS[config.effort]
        if config is not None and config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": config.format.json_schema}}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            error = invalid_body(exc)
            raise APIError(400, error.message, error.param, error.code) from None
        except APIError as exc:
            raise anthropic_named(exc) from None


# chat request fields → the Messages API's fields they came from
_FIELDS = {"thinking_token_budget": "thinking", "stop": "stop_sequences", "reasoning_effort": "output_config.effort",
           "response_format": "output_config.format", "tool_choice": "tool_choice"}


def anthropic_named(error: APIError) -> APIError:
    """A chat-pipeline error named after the Messages API field it came from."""
    param = _FIELDS.get(error.param or "", error.param)
    message = error.message
    for chat_field, field in _FIELDS.items():
        message = message.replace(chat_field, field)
    return APIError(error.status, message, param, error.code, error.headers)


def usage_of(usage: Usage | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those not read from the cache (the prefix cache's hits are
    cache_read_input_tokens); nothing is written to a cache the client pays for."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def stop_fields(output: RequestOutput, has_calls: bool) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` of a message that ended so."""
    outcome = outcome_of(output)
    if isinstance(output.stop_reason, str) and output.finish_reason == FinishReason.STOP:
        return {"stop_reason": "stop_sequence", "stop_sequence": output.stop_reason}
    reason = "tool_use" if has_calls and output.finish_reason == FinishReason.STOP else outcome.anthropic_stop_reason
    return {"stop_reason": reason, "stop_sequence": None}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesFormatter:
    """Engine outputs → Anthropic's message, streamed as typed events or whole."""

    def __init__(self, message_id: str, model: str, num_prompt_tokens: int, tool_syntax: ToolSyntax | None,
                 omit_thinking: bool = False) -> None:  # fmt: skip
        """`omit_thinking` (thinking.display: omitted): thinking blocks come without their text."""
        self.omit_thinking = omit_thinking
        self.id = message_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.tool_syntax = tool_syntax
        self.tool_stream = tool_syntax.stream() if tool_syntax is not None else None
        self.num_blocks = 0
        self._open: str | None = None  # the type of the block being written
        self._has_calls = False

    def _message(self, content: list[dict[str, Any]], usage: dict[str, Any], **stop: Any) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": None, "stop_sequence": None, **stop, "usage": usage}

    def first_chunks(self) -> list[Chunk]:
        usage = {"input_tokens": self.num_prompt_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": self._message([], usage)}, {"type": "ping"}]

    def chunks(self, output: RequestOutput) -> list[Chunk]:
        if is_failure(output):
            return [anthropic_error_body(outcome_of(output).status, failure_message(output))]
        thinking = "" if self.omit_thinking else output.reasoning
        events: list[Chunk] = self._delta("thinking", thinking) if output.reasoning else []
        pieces: list[str | dict[str, Any]] = [output.text] if output.text else []
        if self.tool_stream is not None:
            pieces = self.tool_stream.feed(output.text) + (self.tool_stream.finish() if output.finish_reason else [])
        for piece in pieces:
            if isinstance(piece, str):
                events += self._delta("text", piece)
            elif "id" in piece:  # a call begins
                events += self._close()
                self._has_calls = True
                block = {"type": "tool_use", "id": tool_use_id(piece["id"]), "name": piece["function"]["name"],
                         "input": {}}  # fmt: skip
                events += self._open_block(block)
                if piece["function"]["arguments"]:
                    events.append(self._block_delta({"type": "input_json_delta",
                                                     "partial_json": piece["function"]["arguments"]}))
            else:
                events.append(self._block_delta({"type": "input_json_delta",
                                                 "partial_json": piece["function"]["arguments"]}))
        if output.finish_reason is not None:
            events += self._close()
            if output.finish_reason == FinishReason.ABORT_CLIENT:
                return events
            usage = usage_of(output.usage)
            events.append({"type": "message_delta", "delta": stop_fields(output, self._has_calls), "usage": usage})
            events.append({"type": "message_stop"})
        return events

    def last_chunks(self) -> list[Chunk]:
        return []

    def _delta(self, kind: str, text: str) -> list[Chunk]:
        events: list[Chunk] = []
        if self._open != kind:
            events += self._close()
            events += self._open_block({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                       else {"type": "text", "text": ""})  # fmt: skip
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        return [*events, self._block_delta(delta)]

    def _open_block(self, block: dict[str, Any]) -> list[Chunk]:
        self._open = block["type"]
        return [{"type": "content_block_start", "index": self.num_blocks, "content_block": block}]

    def _block_delta(self, delta: dict[str, Any]) -> Chunk:
        return {"type": "content_block_delta", "index": self.num_blocks, "delta": delta}

    def _close(self) -> list[Chunk]:
        if self._open is None:
            return []
        events: list[Chunk] = []
        if self._open == "thinking":  # the SDKs expect one; treadle signs nothing
            events.append(self._block_delta({"type": "signature_delta", "signature": ""}))
        events.append({"type": "content_block_stop", "index": self.num_blocks})
        self._open = None
        self.num_blocks += 1
        return events

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        (output,) = merge_outputs(outputs)
        content: list[dict[str, Any]] = []
        if output.reasoning:
            content.append({"type": "thinking", "thinking": "" if self.omit_thinking else output.reasoning,
                            "signature": ""})
        text, calls = output.text, []
        if self.tool_syntax is not None:
            text, calls = split_calls(self.tool_syntax, output.text)
        if text and (text.strip() or not calls):
            content.append({"type": "text", "text": text})
        for call in calls:
            try:
                arguments = json.loads(call.arguments)
            except ValueError:  # cut by max_tokens: what was written, as Anthropic's API never shows
                arguments = {"_partial_json": call.arguments}
            content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments})
        return self._message(content, usage_of(request_usage(outputs)), **stop_fields(output, bool(calls)))
