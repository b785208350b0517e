"""Ollama's API: the request bodies of /api/chat and /api/generate, their translation into the chat (or,
for `raw` generation, the completion) pipeline's request, and the NDJSON chunks that answer them; and
the model card the listing routes share.

Ollama's `options` map onto sampling fields (`num_predict` → max_tokens, `repeat_penalty` →
repetition_penalty, ...). Options that would change the output and are not implemented (mirostat,
typical_p, tfs_z, ...) at a value other than their neutral one are a 400 naming them; options that
only tune Ollama's own runtime (num_thread, num_gpu, use_mmap, ...) change nothing here and are named
in a `Warning` header, as are options treadle does not know.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from decoding.engine.outputs import FinishReason, RequestOutput
from decoding.model.model import Model

from .errors import APIError, invalid_body
from .outcomes import failure_message, is_failure, outcome_of
from .protocol import Chunk, merge_outputs, request_usage
from .schema_base import NonEmptyStr, StrictBody
from .schemas import ChatCompletionRequest, CompletionRequest
from .tools import ToolSyntax, split_calls

# option → the sampling field it sets
SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                    "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}  # fmt: skip
# options that change the output, with the values that change nothing
UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "mirostat": (0,), "mirostat_tau": (5.0, 5), "mirostat_eta": (0.1,), "typical_p": (1.0, 1), "tfs_z": (1.0, 1),
    "repeat_last_n": (64, -1), "penalize_newline": (True, False),
}  # fmt: skip
# Ollama's runtime knobs: nothing to change here
RUNTIME_OPTIONS = frozenset({"num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "use_mlock", "numa",
                             "low_vram", "num_keep", "vocab_only", "f16_kv", "logits_all", "embedding_only"})
THINK_LEVELS = ("low", "medium", "high")


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


class OllamaFunctionCall(StrictBody):
    name: NonEmptyStr
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(StrictBody):
    function: OllamaFunctionCall


class OllamaMessage(StrictBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None  # a tool message: the function whose result it is


class _OllamaBody(StrictBody):
    model: NonEmptyStr
    stream: bool = True  # Ollama streams unless told not to
    format: Annotated[Literal["json"] | dict[str, Any], Field(union_mode="left_to_right")] | Literal[""] | None = None
    options: dict[str, Any] | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: str | int | float | None = None  # the model stays loaded anyway

    def common_fields(self, warnings: list[str]) -> dict[str, Any]:
        """The chat/completion fields its format and options ask for; ignored options go to `warnings`."""
        fields: dict[str, Any] = {"stream": self.stream}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            schema = {"name": "format", "schema": self.format}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        for name, value in (self.options or {}).items():
            if name in SAMPLING_OPTIONS:
                if name == "num_predict" and isinstance(value, int) and value < 0:
                    continue  # -1: no limit, -2: fill the context — the server's default either way
                fields[SAMPLING_OPTIONS[name]] = value
            elif name in UNSUPPORTED_OPTIONS:
                if value not in UNSUPPORTED_OPTIONS[name]:
                    raise APIError(400, f"option {name} is not supported: it would change the output and treadle does "
                                        "not implement it (omit it)", f"options.{name}")  # fmt: skip
            elif name != "num_ctx":
                warnings.append(name)
        return fields

    @property
    def num_ctx(self) -> int | None:
        value = (self.options or {}).get("num_ctx")
        return value if isinstance(value, int) else None


class OllamaChatRequest(_OllamaBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def chat_request(self, thinking_model: bool, warnings: list[str]) -> ChatCompletionRequest:
        messages: list[dict[str, Any]] = []
        for i, message in enumerate(self.messages):
            if message.images:
                raise APIError(400, "images are not supported: treadle serves text models", f"messages.{i}.images")
            entry: dict[str, Any] = {"role": message.role, "content": message.content}
            if message.role == "assistant" and message.tool_calls:
                entry["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function", "function": {
                    "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                    for j, c in enumerate(message.tool_calls)]  # fmt: skip
            if message.role == "assistant" and message.thinking:
                entry["reasoning_content"] = message.thinking
            if message.role == "tool" and message.tool_name:
                entry["name"] = message.tool_name
            messages.append(entry)
        if not messages:
            raise APIError(400, "messages is empty (Ollama loads a model with an empty chat; treadle's is always "
                                "loaded)", "messages")  # fmt: skip
        body = {"messages": messages, **self.common_fields(warnings), **_thinking(self.think, thinking_model)}
        if self.tools:
            body["tools"] = self.tools
        return _validated(ChatCompletionRequest, body)


class OllamaGenerateRequest(_OllamaBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    def refuse_unsupported(self) -> None:
        if self.template:
            raise APIError(400, "template is not supported (treadle renders the model's own template)", "template")
        if self.context:
            raise APIError(400, "context is not supported: send the conversation to /api/chat instead", "context")
        if self.images:
            raise APIError(400, "images are not supported: treadle serves text models", "images")

    def chat_request(self, thinking_model: bool, warnings: list[str]) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.prompt}]
        body = {"messages": messages, **self.common_fields(warnings), **_thinking(self.think, thinking_model)}
        return _validated(ChatCompletionRequest, body)

    def completion_request(self, warnings: list[str]) -> CompletionRequest:
        """The raw prompt (or, with a suffix, the middle between the prompt and the suffix) completed."""
        return _validated(CompletionRequest, {"prompt": self.prompt, **self.common_fields(warnings)})


def _thinking(think: bool | str | None, thinking_model: bool) -> dict[str, Any]:
    if think is None:
        return {}
    if not thinking_model and think is not False:
        raise APIError(400, "this model does not think (the server runs no reasoning parser)", "think")
    if think is False:
        return {"reasoning_effort": "none"} if thinking_model else {}
    return {"reasoning_effort": think} if isinstance(think, str) else {}


def _validated(schema: type[Any], body: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise ollama_named(invalid_body(exc)) from None
    except APIError as exc:
        raise ollama_named(exc) from None


_FIELDS = {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
           "response_format": "format", "reasoning_effort": "think", "stop": "options.stop"}  # fmt: skip


def ollama_named(error: APIError) -> APIError:
    """A chat-pipeline error named after the Ollama field it came from."""
    param = error.param or ""
    for chat_field, field in _FIELDS.items():
        if param == chat_field:
            param = field
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty"):
        if param == name:
            param = f"options.{name}"
    return APIError(error.status, error.message, param or None, error.code, error.headers)


# ---- the model card ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What Ollama's listing routes say about the served model."""

    name: str
    size: int  # bytes on disk
    digest: str
    format: str  # gguf or safetensors
    family: str
    parameter_count: int
    quantization_level: str
    context_length: int
    modified_at: str

    @classmethod
    def of(cls, model: Model, name: str, context_length: int, digest: str) -> ModelCard:
        path = model.path
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        weights = model.weights
        matrices = [weights.token_embedding, *(m for layer in weights.layers for m in (
            layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))]  # fmt: skip
        if weights.lm_head is not weights.token_embedding:
            matrices.append(weights.lm_head)
        modified = max(f.stat().st_mtime for f in files)
        quantization = (None if path.is_dir() else _gguf_file_type(path)) or next(iter(weights.storage_types()), "F32")
        return cls(name, sum(f.stat().st_size for f in files), digest, "safetensors" if path.is_dir() else "gguf",
                   model.config.architecture, sum(m.n_rows * m.n_cols for m in matrices), quantization, context_length,
                   datetime.datetime.fromtimestamp(modified, datetime.UTC).isoformat().replace("+00:00", "Z"))

    @property
    def parameter_size(self) -> str:
        count = self.parameter_count
        return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": self.parameter_size, "quantization_level": self.quantization_level}

    def listing(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details()}


def _gguf_file_type(path: Path) -> str | None:
    """The file's type as llama.cpp names it (`Q4_K_M`), from its `general.file_type`; None if it has none."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get("general.file_type")
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_") if field else None
    except (ValueError, OSError, IndexError):
        return None


# ---- answers --------------------------------------------------------------------------------------------


class OllamaFormatter:
    """Engine outputs → Ollama's chunks (NDJSON lines) or one whole answer, for /api/chat (`message`) or
    /api/generate (`response`); durations in nanoseconds, measured here."""

    def __init__(self, model: str, is_chat: bool, tool_syntax: ToolSyntax | None) -> None:
        self.model = model
        self.is_chat = is_chat
        self.tool_syntax = tool_syntax
        self.tool_stream = tool_syntax.stream() if tool_syntax is not None else None
        self.started = time.monotonic_ns()
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls being streamed, by index

    def _chunk(self, text: str, thinking: str = "", calls: list[dict[str, Any]] | None = None,
               done: bool = False) -> Chunk:  # fmt: skip
        chunk: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            chunk["message"] = message
        else:
            chunk["response"] = text
            if thinking:
                chunk["thinking"] = thinking
        chunk["done"] = done
        return chunk

    def first_chunks(self) -> list[Chunk]:
        return []

    def chunks(self, output: RequestOutput) -> list[Chunk]:
        if is_failure(output):
            return [{"error": failure_message(output)}]
        text, calls = output.text, []
        if self.tool_stream is not None:
            pieces = self.tool_stream.feed(output.text) + (self.tool_stream.finish() if output.finish_reason else [])
            text = "".join(p for p in pieces if isinstance(p, str))
            deltas = [p for p in pieces if not isinstance(p, str)]
            calls = self._finished_calls(deltas, output.finish_reason is not None)
        chunks = [self._chunk(text, output.reasoning, calls)] if text or output.reasoning or calls else []
        if output.finish_reason is not None and output.finish_reason != FinishReason.ABORT_CLIENT:
            chunks.append(self._last(output))
        return chunks

    def _finished_calls(self, deltas: list[dict[str, Any]], at_end: bool) -> list[dict[str, Any]]:
        """Ollama sends each call whole: collect its deltas, send it once the next begins or the answer ends."""
        done: list[dict[str, Any]] = []
        for delta in deltas:
            index = delta["index"]
            if "id" in delta:
                done += [self.calls.pop(i) for i in sorted(self.calls) if i < index]
                self.calls[index] = {"name": delta["function"]["name"], "arguments": ""}
            self.calls[index]["arguments"] += delta["function"]["arguments"]
        if at_end:
            done += [self.calls.pop(i) for i in sorted(self.calls)]
        return [_ollama_call(c["name"], c["arguments"]) for c in done]

    def _last(self, output: RequestOutput, text: str = "", thinking: str = "",
              calls: list[dict[str, Any]] | None = None) -> Chunk:  # fmt: skip
        usage = output.usage
        chunk = self._chunk(text, thinking, calls, done=True)
        evaluated = usage.prompt_tokens - usage.cached_tokens if usage else 0  # the prefix cache's hits are not
        prompt_ns = int(usage.prompt_seconds * 1e9) if usage else 0
        eval_ns = int(usage.decode_seconds * 1e9) if usage else 0
        chunk.update({"done_reason": outcome_of(output).ollama_done_reason,
                      "total_duration": max(time.monotonic_ns() - self.started, prompt_ns + eval_ns),
                      "load_duration": 0, "prompt_eval_count": evaluated, "prompt_eval_duration": prompt_ns,
                      "eval_count": usage.completion_tokens if usage else 0, "eval_duration": eval_ns})  # fmt: skip
        return chunk

    def last_chunks(self) -> list[Chunk]:
        return []

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        (output,) = merge_outputs(outputs)
        output.usage = request_usage(outputs)
        text, calls = output.text, []
        if self.tool_syntax is not None:
            text, parsed = split_calls(self.tool_syntax, output.text)
            calls = [_ollama_call(c.name, c.arguments) for c in parsed]
            text = text if text.strip() or not calls else ""
        return self._last(output, text, output.reasoning, calls)


def _ollama_call(name: str, arguments: str) -> dict[str, Any]:
    """A call in Ollama's shape: its arguments as an object (a cut one as what was written)."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = {"_partial_json": arguments}
    return {"function": {"name": name, "arguments": parsed}}
