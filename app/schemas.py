"""Request bodies: OpenAI's field names plus vLLM's extras, validated strictly ("1" is not a number).

`CompletionRequest` is what came over HTTP; `SamplingParams` is what the engine runs. Ranges are
checked once, by `SamplingParams` (an `InvalidParams` becomes a 400 naming the field); the bounds
repeated here only document the API in /openapi.json. A field that would change the output and is not
implemented is refused by name (`NOT_IMPLEMENTED`); other unknown fields (`user`, `metadata`, ...)
change nothing and are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from decoding.engine.params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from decoding.engine.structured import Constraint

from .errors import APIError
from .reasoning import check_template_kwargs
from .schema_base import (
    CHAT_NOT_IMPLEMENTED,
    COMPLETION_NOT_IMPLEMENTED,
    MESSAGE_NOT_IMPLEMENTED,
    NOT_IMPLEMENTED,
    NonEmptyStr,
    Prompt,
    Stop,
    StrictBody,
    one_of,
    refuse_not_implemented,
)


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], one_of("must be a string or a list of {type: text, text} parts")]


class FunctionCall(StrictBody):
    name: NonEmptyStr
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's thinking, in the history (vLLM's and DeepSeek's name)
    reasoning: str | None = None  # the same (vLLM's newer name)

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        """As OpenAI: only an assistant message may go without content (it may have called a tool)."""
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"is required in a {role} message")
        return value

    def as_template_input(self) -> dict[str, Any]:
        """What the chat template sees: content parts joined by newlines, as vLLM joins them."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:  # templates expect the arguments as a mapping (as vLLM passes them)
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_mapping(c.function.arguments)}}
                for c in self.tool_calls]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role == "assistant":  # under both names: templates read either
            message["reasoning_content"] = message["reasoning"] = thinking
        return message


def _arguments_mapping(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text


class StreamOptions(StrictBody):
    include_usage: bool = False


class JsonSchemaFormat(StrictBody):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # `schema` is BaseModel's
    strict: bool | None = None  # the schema is always enforced: strict or not, the output matches it


class ResponseFormat(StrictBody):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class StructuredOutputs(StrictBody):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, a choice of strings, a Lark grammar."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # `json` is BaseModel's
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_schema", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]  # fmt: skip
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        return self

    def constraint(self) -> Constraint:
        if self.json_schema is not None:
            return _json_schema_constraint(self.json_schema, "structured_outputs.json")
        if self.json_object:
            return Constraint("json_object", "", "structured_outputs.json_object")
        if self.regex is not None:
            return Constraint("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            return Constraint("choice", json.dumps(self.choice), "structured_outputs.choice")
        return Constraint("grammar", self.grammar or "", "structured_outputs.grammar")


def _json_schema_constraint(schema: dict[str, Any] | str, field: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise APIError(400, f"{field} is not valid JSON: {exc}", field) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{field} must be a JSON schema (an object)", field)
    return Constraint("json", json.dumps(schema), field)  # key order kept: properties come in schema order


class SchedulingFields(StrictBody):
    """When a generation runs: vLLM's `priority` (lower is admitted first) and a queue `timeout` in
    seconds (a request not started by then is answered 503 instead of being served late)."""

    priority: int = Field(0, ge=-(2**31), lt=2**31)
    timeout: float | None = Field(None, gt=0)


class _SamplingBody(SchedulingFields):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    not_implemented: ClassVar[dict[str, tuple[Any, ...]]] = NOT_IMPLEMENTED

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    min_tokens: int = Field(0, ge=0)  # vLLM's; at most max_tokens
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The one constraint the request's structured-output fields ask for, if any."""
        found: list[Constraint] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            found.append(Constraint("json_object", "", "response_format"))
        elif self.response_format is not None and self.response_format.json_schema is not None:
            found.append(_json_schema_constraint(self.response_format.json_schema.json_schema, "response_format"))
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.constraint())
        if self.guided_json is not None:
            found.append(_json_schema_constraint(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            found.append(Constraint("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(Constraint("choice", json.dumps(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(Constraint("grammar", self.guided_grammar, "guided_grammar"))
        if len(found) > 1:
            raise APIError(400, f"{found[0].field} and {found[1].field} both constrain the output: give one",
                           found[1].field)  # fmt: skip
        return found[0] if found else None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_not_implemented(data, cls.not_implemented)
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed with stream: true")  # as OpenAI and vLLM
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        optional = {name: getattr(self, name) for name in (
            "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
        ) if getattr(self, name) is not None}
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=max_tokens, min_tokens=self.min_tokens, n=self.n, seed=self.seed, stop=stop,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              stop_token_ids=tuple(self.stop_token_ids or ()), logit_bias=self._logit_bias(),
                              ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, constraint=self.constraint(),
                              **optional)

    def _logit_bias(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        return bias


class FunctionSpec(StrictBody):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none = a function without arguments
    strict: bool | None = None


class ToolSpec(StrictBody):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictBody):
    name: NonEmptyStr


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                       one_of('must be "none", "auto", "required" '
                               'or {"type": "function", "function": {"name"}}')]  # fmt: skip


class ChatCompletionRequest(_SamplingBody):
    not_implemented = CHAT_NOT_IMPLEMENTED

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # thinking models: variables for the template (`enable_thinking`), the effort, the thinking's budget
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking_token_budget: int | None = Field(None, ge=0)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _plain_template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_template_kwargs(value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs: true")
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_tool_calls_in_messages(cls, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(message, dict):
                refuse_not_implemented(message, MESSAGE_NOT_IMPLEMENTED, f"messages.{i}.")
        return data

    @model_validator(mode="after")
    def _tool_choice_within_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        if choice not in (None, "none") and not names:  # as OpenAI
            raise APIError(400, f"tool_choice {json.dumps(choice if isinstance(choice, str) else 'function')} needs "
                                "tools", "tool_choice")  # fmt: skip
        for tool in self.tools or []:
            if tool.function.strict and tool.function.parameters is None:
                raise APIError(400, f"function {tool.function.name!r} is strict but has no parameters schema",
                               "tools")  # fmt: skip
        return self

    @property
    def calls_tools(self) -> bool:
        """Tools go to the model (and its calls are read back): tools given, and tool_choice not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_a_call(self) -> bool:
        return self.calls_tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def called_functions(self) -> list[dict[str, Any]]:
        """The functions a forced call may call (all, or the named one), as dicts."""
        choice = self.tool_choice
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []
                if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]  # fmt: skip

    def tools_for_template(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, None)

    def template_input(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


class CompletionRequest(_SamplingBody):
    not_implemented = COMPLETION_NOT_IMPLEMENTED

    prompt: Prompt  # one prompt: text, or token ids
    suffix: str | None = None  # fill in the middle: the text after the completion (code models trained for it)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the top k alternatives per token

    @model_validator(mode="after")
    def _suffix_with_text(self) -> CompletionRequest:
        if self.suffix and not isinstance(self.prompt, str):
            raise APIError(400, "suffix needs a text prompt (not token ids)", "suffix")
        if self.suffix and self.echo:
            raise APIError(400, "suffix cannot be combined with echo", "suffix")
        return self

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        # `echo` with `logprobs` reports the prompt's tokens too, as OpenAI's legacy completions did.
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class TokenizeRequest(StrictBody):
    """vLLM's /tokenize: a plain prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
