"""OpenAI's Responses API request: its body, checked field by field, and its translation into the chat
pipeline's request (`ResponsesRequest.chat_request()`), so a Responses request is answered by the
chat machinery: template, tools, structured output, sampling."""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from .errors import APIError, invalid_body
from .schema_base import StrictBody, one_of, refuse_not_implemented
from .schemas import ChatCompletionRequest, SchedulingFields

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
