"""Tool calling: the model's tool-call syntax, read from its chat template, as a parser and a grammar.

One class per syntax (`ToolSyntax`; the others are in tool_syntaxes.py, with the registry that picks
one from the template). `HermesToolCalls` is the one Qwen2.5 (and Hermes, and many fine-tunes) use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`constraint` turns `tool_choice: "required"` or a named function into a grammar over that syntax whose
arguments match each function's `parameters` schema; `call_trigger` gives `auto` the grammar of a call
the model begins; `ToolCallStream` splits a choice's streamed text into content and OpenAI's tool-call
deltas (a call's name, then its arguments as they are written), holding back only what could still
be the start of a call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from decoding.engine.params import ToolCallTrigger
from decoding.engine.structured import JSON_LAYOUT, Constraint

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallStream(Protocol):
    """One choice's text, fed as it streams, as OpenAI's deltas (see ToolCallStream)."""

    num_calls: int

    def feed(self, text: str) -> list[str | dict[str, Any]]: ...
    def finish(self) -> list[str | dict[str, Any]]: ...


class ToolSyntax:
    """How one family of models writes tool calls: read back from the text (`stream`), and as grammars
    for a forced call (`constraint`) and for a call the model begins under `auto` (`call_trigger`).
    An instance is bound to a request's functions."""

    name: ClassVar[str]  # vLLM's --tool-call-parser name
    tags: ClassVar[tuple[str, ...]] = ()  # texts that may be tokens of their own (grammars name them by id)

    def __init__(self, functions: list[dict[str, Any]] | None = None) -> None:
        self.functions = functions or []

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        raise NotImplementedError

    def constraint(self, functions: list[dict[str, Any]], parallel: bool,
                   tag_token_ids: dict[str, int | None]) -> Constraint:  # fmt: skip
        raise NotImplementedError

    def call_trigger(self, functions: list[dict[str, Any]],
                     tag_token_ids: dict[str, int | None]) -> ToolCallTrigger | None:  # fmt: skip
        return None

    def stream(self) -> CallStream:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_call_id()

    def parse_call(self, body: str) -> ToolCall | None:
        """A call written as JSON `{"name": ..., "arguments" | "parameters": ...}`, or None if it is not one."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(call["name"], text, self.new_call_id())

    @staticmethod
    def _tag(tag: str, tag_token_ids: dict[str, int | None]) -> str:
        """A tag in a Lark grammar: by its token id where it is one token (the tokenizer does not match a
        special token by its text), else as text."""
        return f"<[{tag_token_ids[tag]}]>" if tag_token_ids.get(tag) is not None else json.dumps(tag)


class HermesToolCalls(ToolSyntax):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    tags = (start, end)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return cls.start in chat_template

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def constraint(self, functions: list[dict[str, Any]], parallel: bool,
                   tag_token_ids: dict[str, int | None]) -> Constraint:  # fmt: skip
        """Output that is nothing but calls (one, or several if `parallel`) of these functions.
        `tag_token_ids`: the token that spells each tag, where one does (Qwen's are tokens of their
        own, which the grammar must name by id: the tokenizer does not match them by their text)."""
        start, end = (self._tag(tag, tag_token_ids) for tag in (self.start, self.end))
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = (f"start: call{repeat}\n"
                f'call: {start} "\\n" body "\\n" {end}\n'
                f"body: %json {json.dumps(self._body_schema(functions))}\n")  # fmt: skip
        return Constraint("grammar", lark, "tool_choice")

    def call_trigger(self, functions: list[dict[str, Any]],
                     tag_token_ids: dict[str, int | None]) -> ToolCallTrigger | None:  # fmt: skip
        """For tool_choice auto: the token that opens a call and the grammar of what follows it, so that
        a call the model begins has valid arguments; None where the opening tag is not one token."""
        opening = tag_token_ids.get(self.start)
        if opening is None:
            return None
        lark = (f'start: "\\n" body "\\n" {self._tag(self.end, tag_token_ids)}\n'
                f"body: %json {json.dumps(self._body_schema(functions))}\n")  # fmt: skip
        return ToolCallTrigger(opening, Constraint("grammar", lark, "tools"))

    @staticmethod
    def _body_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
        return call_body_schema(functions, "arguments")


def call_body_schema(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call `{"name": ..., arguments_key: {...}}` of any of `functions`."""
    bodies = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
               "properties": {"name": {"const": f["name"]}, arguments_key: f.get("parameters") or EMPTY_PARAMETERS}}
              for f in functions]  # fmt: skip
    return {"x-guidance": JSON_LAYOUT, "anyOf": bodies}


_CALL_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class ToolCallStream:
    """One choice's text, fed as it streams, as OpenAI's deltas: content (str) and tool-call deltas
    (dict): for each call, first `{"index", "id", "type", "function": {"name", "arguments": ""}}`
    as soon as its name is known, then `{"index", "function": {"arguments": fragment}}` as its
    arguments arrive. Only what could still be the start of a call is held back.

    Arguments stream as the model writes them when the call's body begins `{"name": ..., "arguments": {`
    (what Hermes templates show, and the only form the tool grammars allow); a call in another form
    (keys the other way round, arguments as a string) is sent whole once its end tag arrives, and a
    tagged block that is not a call is content."""

    def __init__(self, syntax: HermesToolCalls) -> None:
        self.syntax = syntax
        self.new_call_id = syntax.new_call_id
        self.pending = ""  # text that may be (the start of) a call
        self.num_calls = 0  # calls begun (the next call's delta index)
        self.after_call = False  # the newlines that separate calls are not content
        self._arguments: JsonValueScanner | None = None  # the streamed call's arguments, once its name is sent

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        self.pending += text
        events: list[str | dict[str, Any]] = []
        start, end = self.syntax.start, self.syntax.end
        while self.pending:
            if self._arguments is not None:
                if not self._stream_arguments(events):
                    break
                continue
            if self.after_call:
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.after_call = False
            at = self.pending.find(start)
            if at < 0:  # no call begins here: all but a possible start of one is content
                keep = partial_suffix(self.pending, start)
                if len(self.pending) > keep:
                    events.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                break
            if at > 0:
                events.append(self.pending[:at])
                self.pending = self.pending[at:]
            header = _CALL_HEADER.match(self.pending, len(start))
            close = self.pending.find(end)
            if header is not None and (close < 0 or header.end() < close):
                events.append({"index": self.num_calls, "id": self.new_call_id(), "type": "function",
                               "function": {"name": json.loads(f'"{header.group(1)}"'), "arguments": ""}})  # fmt: skip
                self._arguments = JsonValueScanner()
                self.pending = self.pending[header.end() :]
                continue
            if close < 0:
                break  # inside a call whose name is not known yet: wait
            call = self.syntax.parse_call(self.pending[len(start) : close].strip())
            if call is None:
                events.append(self.pending[: close + len(end)])
            else:
                events.append({"index": self.num_calls, **call.as_openai()})
                self.num_calls += 1
            self.after_call = call is not None
            self.pending = self.pending[close + len(end) :]
        return [e for e in events if not (isinstance(e, str) and e == "")]

    def _stream_arguments(self, events: list[str | dict[str, Any]]) -> bool:
        """Send the arguments read so far; once they are complete, drop the rest of the call up to its
        end tag. Returns whether the call is over (the caller goes on with what follows it)."""
        scanner = self._arguments
        assert scanner is not None
        if not scanner.is_complete:
            self.pending = take_arguments(scanner, self.pending, self.num_calls, events)
            if not scanner.is_complete:
                return False
        close = self.pending.find(self.syntax.end)
        if close < 0:
            return False
        self.pending = self.pending[close + len(self.syntax.end) :]
        self._arguments = None
        self.num_calls += 1
        self.after_call = True
        return True

    def finish(self) -> list[str | dict[str, Any]]:
        """What is left when the choice ends: an unfinished call whose name was sent stays a call (its
        arguments cut where the answer was, as OpenAI's are at `max_tokens`); any other unfinished
        call is returned as text."""
        rest, self.pending = self.pending, ""
        if self._arguments is not None:
            self._arguments = None
            self.num_calls += 1
            return []
        return [rest] if rest else []


def take_arguments(scanner: JsonValueScanner, text: str, index: int, events: list[str | dict[str, Any]]) -> str:
    """Feed `text` to a call's arguments, sending the part that belongs to them as a fragment of call
    `index`; returns the rest."""
    taken = scanner.feed(text)
    if taken:
        events.append({"index": index, "function": {"arguments": text[:taken]}})
    return text[taken:]


class JsonValueScanner:
    """Where a JSON object or array that is being streamed ends (strings and escapes respected)."""

    __slots__ = ("depth", "escaped", "in_string", "is_complete")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.is_complete = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all, unless it ends inside `text`)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.is_complete = True
                    return i + 1
        return len(text)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_calls(syntax: ToolSyntax, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer: its content (the text outside calls) and its calls — what its stream's deltas
    add up to, so that streamed and whole answers agree."""
    stream = syntax.stream()
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for event in stream.feed(text) + stream.finish():
        if isinstance(event, str):
            content.append(event)
            continue
        call = calls.setdefault(event["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] = event.get("id", call["id"])
        call["name"] = event["function"].get("name", call["name"])
        call["arguments"] += event["function"]["arguments"]
    return "".join(content), [ToolCall(c["name"], c["arguments"], c["id"]) for c in calls.values()]
