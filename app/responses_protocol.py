"""OpenAI's Responses API (text in and out, function tools): the request body, its translation into
the chat pipeline's request, and the response object with the typed events that build it.

A Responses request is answered by the chat machinery (template, tools, structured output, sampling):
`ResponsesRequest.chat_request()` writes the equivalent chat request. What comes back is formatted
here: `ResponseState` is the response object as it stands (what `GET /v1/responses/{id}` returns, also
while it runs), and `ResponsesFormatter` turns engine outputs into the stream's events — created,
in_progress, an output item per message or function call with its parts and deltas, then completed,
incomplete or failed — updating the state as it goes, so the two never disagree.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from decoding.engine.outputs import FinishReason, RequestOutput, Usage

from .errors import APIError, invalid_body
from .outcomes import failure_message, is_failure, outcome_of
from .protocol import Chunk
from .schema_base import StrictBody, one_of, refuse_not_implemented
from .schemas import ChatCompletionRequest, SchedulingFields
from .tools import ToolSyntax

# Fields that would change the output and are not implemented, with the values that change nothing.
RESPONSES_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "include": (None, []),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "prompt": (None,),
    "conversation": (None,),
    "context_management": (None,),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class InputText(StrictBody):
    type: Literal["input_text", "output_text", "text"]
    text: str


InputContent = Annotated[str | list[InputText],
                         one_of("must be a string or a list of {type: input_text, text} parts (only text is "
                                 "supported)")]  # fmt: skip


class InputMessage(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: InputContent

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(StrictBody):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictBody):
    """A thinking model's reasoning from an earlier response, given back: it goes to the template with the
    assistant turn after it (which keeps or drops it, as the model's template does)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # treadle makes none, so none can come back
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      one_of("must be a message {role, content}, a function_call, a function_call_output or a "
                              "reasoning item (other input items are not supported)")]  # fmt: skip


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictBody):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


ResponsesToolChoice = Annotated[Literal["none", "auto", "required"] | NamedFunctionChoice,
                                one_of('must be "none", "auto", "required" '
                                        'or {"type": "function", "name"}')]  # fmt: skip


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.json_schema is None or not self.name):
            raise ValueError("type json_schema needs a name and a schema")
        return self


class TextOptions(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # only medium (the default) changes nothing


class ReasoningOptions(StrictBody):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: None = None  # treadle writes no summaries of the thinking: its text is given whole


class ResponsesRequest(SchedulingFields):
    model: str | None = None
    input: Annotated[str | Annotated[list[InputItem], Field(min_length=1)],
                     one_of("must be a string or a non-empty list of input items")]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None  # vLLM accepts it here too
    reasoning: ReasoningOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_not_implemented(data, RESPONSES_NOT_IMPLEMENTED)
            tools = data.get("tools")
            for i, tool in enumerate(tools if isinstance(tools, list) else []):  # else the type check's 400
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: only function tools "
                                        "(treadle runs no built-in tools)", f"tools.{i}.type",
                                   code="unsupported_parameter")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise APIError(400, "background responses must be stored (store: true), or nobody could fetch them",
                           "store")  # fmt: skip
        if self.text is not None and self.text.verbosity in ("low", "high"):
            raise APIError(400, f"text.verbosity {self.text.verbosity} is not supported (omit it or send medium)",
                           "text.verbosity", code="unsupported_parameter")  # fmt: skip
        return self

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (OpenAI's chat shape: consecutive function calls become one
        assistant message with tool_calls; a call's output a tool message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        thinking: str | None = None  # a reasoning item's text, for the assistant turn that follows it
        for item in self.input:
            if isinstance(item, ReasoningItem):
                thinking = (thinking or "") + item.text()
                continue
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and thinking is None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            if thinking is not None and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = thinking
            thinking = None
        return messages

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that answers this one, after `history` (a previous response's conversation)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        body: dict[str, Any] = {
            "messages": messages + self.input_messages(), "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "seed": self.seed, "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority,
            "timeout": self.timeout,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
        }
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]  # fmt: skip
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif text_format is not None and text_format.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.name, "schema": text_format.json_schema, "strict": text_format.strict}}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # what the input items make of messages: named after `input`
            error = invalid_body(exc)
            raise APIError(400, error.message, "input" if (error.param or "").startswith("messages") else error.param,
                           error.code) from None
        except APIError as exc:  # named after the Responses field it came from
            param = {"response_format": "text.format", "messages": "input"}.get(exc.param or "", exc.param)
            raise APIError(exc.status, exc.message.replace("response_format", "text.format"), param,
                           exc.code) from None


def usage_of(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}


class ResponseState:
    """The response object as it stands; the formatter updates it as events are made."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str) -> None:
        self.id = response_id
        self.body = body
        self.model = model
        self.created_at = int(time.time())
        self.status = "queued" if body.background else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.failure: FinishReason | None = None  # why it failed, where it did
        self.incomplete_details: dict[str, Any] | None = None
        self.finished_at: float | None = None  # time.monotonic() when its last event was made
        self.history: list[dict[str, Any]] = []  # the previous response's conversation, if it continues one
        self.conversation: list[dict[str, Any]] = []  # history, input and answer, for a later previous_response_id

    @property
    def is_finished(self) -> bool:
        return self.finished_at is not None

    def as_dict(self) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": body.background, "error": self.error, "incomplete_details": self.incomplete_details,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": [dict(item) for item in self.output], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                            else body.tool_choice.model_dump()) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
            "usage": self.usage, "metadata": body.metadata or {}, "user": body.user,
        }



class ResponsesFormatter:
    """Engine outputs → the Responses API's stream events, each with its `sequence_number`."""

    def __init__(self, state: ResponseState, tool_syntax: ToolSyntax | None) -> None:
        self.state = state
        self.tool_stream = tool_syntax.stream() if tool_syntax is not None else None
        self.num_events = 0
        self._open: dict[str, Any] | None = None  # the output item being written
        self._text = ""  # the open message's text so far

    def _event(self, kind: str, **fields: Any) -> Chunk:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def first_chunks(self) -> list[Chunk]:
        self.state.status = "in_progress"
        snapshot = self.state.as_dict()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunks(self, output: RequestOutput) -> list[Chunk]:
        events: list[Chunk] = self._text_delta(output.reasoning, "reasoning") if output.reasoning else []
        pieces: list[str | dict[str, Any]] = [output.text] if output.text else []
        if self.tool_stream is not None:
            pieces = self.tool_stream.feed(output.text)
            if output.finish_reason is not None:
                pieces += self.tool_stream.finish()
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text_delta(piece)
            elif "id" in piece:  # a call begins
                events += self._close_item()
                events += self._open_item({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                           "arguments": "", "call_id": piece["id"], "name": piece["function"]["name"]})
                if piece["function"]["arguments"]:
                    events += self._arguments_delta(piece["function"]["arguments"])
            else:
                events += self._arguments_delta(piece["function"]["arguments"])
        if output.finish_reason is not None:
            events += self._close_item()
            events += self._finish(output)
        return events

    def last_chunks(self) -> list[Chunk]:
        return []

    def _open_item(self, item: dict[str, Any]) -> list[Chunk]:
        self._open = item
        self.state.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.state.output) - 1, item=dict(item))]

    def _text_delta(self, text: str, kind: str = "message") -> list[Chunk]:
        """Text of the answer (`message`) or of the thinking (`reasoning`), in an item of that kind."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_item()
            if kind == "message":
                events += self._open_item({"id": new_id("msg"), "type": "message", "status": "in_progress",
                                           "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                events += self._open_item({"id": new_id("rs"), "type": "reasoning", "status": "in_progress",
                                           "summary": [], "content": []})
                part = {"type": "reasoning_text", "text": ""}
            self._open["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(), part=dict(part)))
        self._text += text
        self._open["content"][0]["text"] = self._text
        if kind == "message":
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **self._where(), delta=text))
        return events

    def _arguments_delta(self, fragment: str) -> list[Chunk]:
        assert self._open is not None
        self._open["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                            output_index=len(self.state.output) - 1, delta=fragment)]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.state.output) - 1, "content_index": 0}

    def _close_item(self) -> list[Chunk]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = len(self.state.output) - 1
        if item["type"] in ("message", "reasoning"):
            part, text = item["content"][0], self._text
            self._text = ""
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = (self._event("response.output_text.done", **where, text=text, logprobs=[])
                    if item["type"] == "message" else self._event("response.reasoning_text.done", **where, text=text))
            events = [done, self._event("response.content_part.done", **where, part=dict(part))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=json.loads(json.dumps(item)))]

    def _finish(self, output: RequestOutput) -> list[Chunk]:
        state = self.state
        state.finished_at = time.monotonic()
        state.usage = usage_of(output.usage)
        outcome = outcome_of(output)
        state.status = outcome.responses_status
        if outcome.finish_reason is not None:
            if output.finish_reason == FinishReason.LENGTH:
                state.incomplete_details = {"reason": "max_output_tokens"}
            state.conversation = self._conversation()
            kind = "response.incomplete" if state.status == "incomplete" else "response.completed"
            return [self._event(kind, response=state.as_dict())]
        if is_failure(output):
            state.failure = FinishReason(output.finish_reason)
            state.error = {"code": outcome.code, "message": failure_message(output)}
        return [self._event("response.failed", response=state.as_dict())]  # failed, or cancelled

    def _conversation(self) -> list[dict[str, Any]]:
        """What a later request with previous_response_id continues: this one's input and its answer."""
        state = self.state
        history = [*state.history, *state.body.input_messages()]
        answer: dict[str, Any] | None = None
        for item in state.output:
            if answer is None:
                answer = {"role": "assistant", "content": None}
                history.append(answer)
            if item["type"] == "reasoning":
                answer["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                answer["content"] = (answer["content"] or "") + item["content"][0]["text"]
            else:
                answer.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return history
