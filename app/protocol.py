"""Engine outputs → OpenAI response objects, streamed (chunks) or whole.

The chunk sequence of a chat stream is what the `openai` package parses and what clients that read
`chunk.choices[0]` survive: per choice a role chunk, content chunks with `"finish_reason": null`, a
finish chunk with an empty delta; a usage chunk with empty `choices` only under
`stream_options.include_usage`. Completions follow the legacy `text_completion` shape.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from decoding.engine.outputs import FinishReason, RequestOutput, Usage
from decoding.engine.sampling import TokenLogprobs
from decoding.model.tokenizer import Tokenizer

from .outcomes import error_event, finish_reason_of, is_failure
from .tools import ToolSyntax, split_calls

Chunk = dict[str, Any]


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable stand-in character of each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenText:
    """A token's own bytes and text for logprobs: a token may hold half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._is_byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        if self._is_byte_level:
            piece = self._tokenizer.backend.id_to_token(token_id) or ""
            byte_of_char = _byte_of_char()
            if all(c in byte_of_char for c in piece):
                return bytes(byte_of_char[c] for c in piece)
        return self._tokenizer.decode([token_id]).encode("utf-8")

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}
    if usage.draft_tokens:  # treadle's extension, only where speculation ran
        body["speculative"] = {"drafted": usage.draft_tokens, "accepted": usage.accepted_draft_tokens}
    return body


@dataclass(slots=True)
class ResponseHeader:
    """The fields every chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None  # OpenAI's; see server.system_fingerprint

    @classmethod
    def new(cls, prefix: str, model: str, system_fingerprint: str | None = None) -> ResponseHeader:
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, system_fingerprint=system_fingerprint)

    def fields(self, object_name: str) -> dict[str, Any]:
        """What every chat or completion object (a chunk or a whole response) starts with."""
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per choice, in index order (deltas of a non-streamed request)."""
    merged: dict[int, RequestOutput] = {}
    for output in outputs:
        if output.index in merged:
            merged[output.index].merge(output)
        else:
            merged[output.index] = output
    return [merged[i] for i in sorted(merged)]


def request_usage(outputs: list[RequestOutput]) -> Usage | None:
    """The request's usage rides on its last delta, which may belong to any choice (n > 1)."""
    return next((o.usage for o in outputs if o.usage is not None), None)


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    """The thinking under both names clients read: `reasoning_content` (vLLM's and DeepSeek's, LiteLLM's)
    and `reasoning` (vLLM's newer one)."""
    return {"reasoning_content": text, "reasoning": text}


class ChatFormatter:
    object_name = "chat.completion"

    def __init__(self, header: ResponseHeader, tokens: TokenText, n: int, include_usage: bool,
                 tool_syntax: ToolSyntax | None = None, is_reasoning: bool = False) -> None:  # fmt: skip
        """`is_reasoning`: a reasoning parser splits the thinking off (`reasoning_content`)."""
        self.header = header
        self.is_reasoning = is_reasoning
        self.tokens = tokens
        self.n = n
        self.include_usage = include_usage
        self.usage: Usage | None = None
        self.tool_syntax = tool_syntax  # the request calls tools: answers are split into content and calls
        self.tool_streams = [tool_syntax.stream() for _ in range(n)] if tool_syntax else []
        self.held_logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]  # tokens whose text is held back

    def _chunk(self, choices: list[dict[str, Any]]) -> Chunk:
        chunk = {**self.header.fields("chat.completion.chunk"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: present on every chunk once asked for, set on the last
        return chunk

    def first_chunks(self) -> list[Chunk]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]

    def chunks(self, output: RequestOutput) -> list[Chunk]:
        if is_failure(output):
            return [error_event(output)]
        chunks = []
        if output.reasoning:  # before the answer's text, with the logprobs of every token the delta holds
            chunks.append(self._chunk([{"index": output.index, "delta": reasoning_fields(output.reasoning),
                                        "logprobs": self.logprobs(output.logprobs), "finish_reason": None}]))
            output.logprobs = []
        if self.tool_syntax is not None:
            return chunks + self._tool_chunks(output)
        logprobs = self.logprobs(output.logprobs)
        if output.text or logprobs:
            chunks.append(self._chunk([{"index": output.index, "delta": {"content": output.text},
                                        "logprobs": logprobs, "finish_reason": None}]))
        if output.finish_reason is not None:
            chunks.append(self._chunk([{"index": output.index, "delta": {}, "logprobs": None,
                                        "finish_reason": finish_reason_of(output), "stop_reason": output.stop_reason}]))
        self.usage = output.usage or self.usage
        return chunks

    def _tool_chunks(self, output: RequestOutput) -> list[Chunk]:
        """Content as it comes, each tool call as OpenAI streams one: a delta with its index (0, 1, ...
        within the choice), id, type and name, then its arguments in fragments; a choice that called
        tools ends with finish_reason tool_calls. Logprobs (of every token, the calls' too, as vLLM)
        go with the first chunk sent after their tokens arrive: the parser may hold text back."""
        stream = self.tool_streams[output.index]
        events = stream.feed(output.text)
        if output.finish_reason is not None:
            events += stream.finish()
        held = self.held_logprobs[output.index]
        held += output.logprobs
        chunks = []
        for event in events:
            delta: dict[str, Any] = {"content": event} if isinstance(event, str) else {"tool_calls": [event]}
            chunks.append(self._chunk([{"index": output.index, "delta": delta, "logprobs": self.logprobs(held),
                                        "finish_reason": None}]))  # fmt: skip
            held.clear()
        if output.finish_reason is not None:
            reason = finish_reason_of(output, has_calls=bool(stream.num_calls))
            chunks.append(self._chunk([{"index": output.index, "delta": {}, "logprobs": self.logprobs(held),
                                        "finish_reason": reason, "stop_reason": output.stop_reason}]))  # fmt: skip
            held.clear()
        self.usage = output.usage or self.usage
        return chunks

    def last_chunks(self) -> list[Chunk]:
        if not self.include_usage:
            return []
        return [{**self._chunk([]), "usage": usage_body(self.usage)}]

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for o in outputs:
            message = self._message(o)
            choices.append({"index": o.index, "message": message, "logprobs": self.logprobs(o.logprobs),
                            "finish_reason": finish_reason_of(o, has_calls="tool_calls" in message),
                            "stop_reason": o.stop_reason})  # fmt: skip
        return {**self.header.fields(self.object_name), "choices": choices,
                "usage": usage_body(request_usage(outputs))}

    def _message(self, output: RequestOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": output.text}
        if self.is_reasoning:
            message.update(reasoning_fields(output.reasoning or None))
        if self.tool_syntax is None or not FinishReason(output.finish_reason or "stop").is_complete:
            return message
        content, calls = split_calls(self.tool_syntax, output.text)
        message["content"] = content if content.strip() or not calls else None
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return message

    def logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.tokens.text_of(token_id), "logprob": logprob,
                    "bytes": list(self.tokens.bytes_of(token_id))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}


class CompletionFormatter:
    """Legacy completions; `echo` puts the prompt (and its logprobs) before each choice's text."""

    def __init__(self, header: ResponseHeader, tokens: TokenText, n: int, include_usage: bool,
                 prompt_ids: list[int], echo_text: str | None) -> None:
        self.header = header
        self.tokens = tokens
        self.n = n
        self.include_usage = include_usage
        self.prompt_ids = prompt_ids
        self.echo_text = echo_text
        self.usage: Usage | None = None
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._echoed: set[int] = set()
        self._text_offset: dict[int, int] = {}  # characters sent so far, per choice

    def _chunk(self, choices: list[dict[str, Any]]) -> Chunk:
        chunk = {**self.header.fields("text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[Chunk]:
        return []

    def _choice(self, output: RequestOutput) -> dict[str, Any]:
        """Text and logprobs of a delta, with the echoed prompt before the first one of its choice."""
        self._prompt_logprobs = output.prompt_logprobs or self._prompt_logprobs
        text = output.text
        entries: list[TokenLogprobs | None] = list(output.logprobs)
        if self.echo_text is not None and output.index not in self._echoed:
            self._echoed.add(output.index)
            text = self.echo_text + text
            entries = [*(self._prompt_logprobs or []), *entries]
        return {"index": output.index, "text": text, "logprobs": self.logprobs(output.index, entries),
                "finish_reason": finish_reason_of(output), "stop_reason": output.stop_reason}

    def chunks(self, output: RequestOutput) -> list[Chunk]:
        if is_failure(output):
            return [error_event(output)]
        self.usage = output.usage or self.usage
        choice = self._choice(output)
        if not choice["text"] and not choice["logprobs"] and choice["finish_reason"] is None:
            return []
        return [self._chunk([choice])]

    def last_chunks(self) -> list[Chunk]:
        if not self.include_usage:
            return []
        return [{**self._chunk([]), "usage": usage_body(self.usage)}]

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return {**self.header.fields("text_completion"), "choices": [self._choice(o) for o in outputs],
                "usage": usage_body(request_usage(outputs))}

    def logprobs(self, index: int, entries: list[TokenLogprobs | None]) -> dict[str, Any] | None:
        """OpenAI's legacy layout: parallel lists; the first prompt token has no logprob (nothing predicts it)."""
        if not entries:
            return None
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            # The unscored first prompt token is known only from the prompt itself.
            text = self.tokens.text_of(self.prompt_ids[0] if entry is None else entry.token_id)
            tokens.append(text)
            offsets.append(self._text_offset.get(index, 0))
            self._text_offset[index] = offsets[-1] + len(text)
            token_logprobs.append(None if entry is None else entry.logprob)
            top_logprobs.append(None if entry is None else {self.tokens.text_of(t): v for t, v in entry.top})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
