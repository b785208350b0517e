"""Tool calling: the model's tool-call syntax, read from its chat template, as a parser and a grammar.

One class per syntax. `HermesToolCalls` is the one Qwen2.5 (and Hermes, and many fine-tunes) use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`constraint` turns `tool_choice: "required"` or a named function into a grammar over that syntax whose
arguments match each function's `parameters` schema; `call_trigger` gives `auto` the grammar of a call
the model begins; `ToolCallStream` splits a choice's streamed text into content and complete tool
calls as they arrive, holding back only what could still be the start of a call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

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


class HermesToolCalls:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

    start, end = "<tool_call>", "</tool_call>"

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return cls.start in chat_template

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
                     tag_token_ids: dict[str, int | None]) -> tuple[int, Constraint] | None:  # fmt: skip
        """For tool_choice auto: the token that opens a call and the grammar of what follows it, so that
        a call the model begins has valid arguments; None where the opening tag is not one token."""
        opening = tag_token_ids.get(self.start)
        if opening is None:
            return None
        lark = (f'start: "\\n" body "\\n" {self._tag(self.end, tag_token_ids)}\n'
                f"body: %json {json.dumps(self._body_schema(functions))}\n")  # fmt: skip
        return opening, Constraint("grammar", lark, "tools")

    @staticmethod
    def _tag(tag: str, tag_token_ids: dict[str, int | None]) -> str:
        return f"<[{tag_token_ids[tag]}]>" if tag_token_ids.get(tag) is not None else json.dumps(tag)

    @staticmethod
    def _body_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
        bodies = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                   "properties": {"name": {"const": f["name"]},
                                  "arguments": f.get("parameters") or EMPTY_PARAMETERS}} for f in functions]  # fmt: skip
        return {"x-guidance": JSON_LAYOUT, "anyOf": bodies}

    def parse_call(self, body: str) -> ToolCall | None:
        """A call's text between the tags, or None if it is not a call."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(call["name"], text, new_call_id())


SYNTAXES = (HermesToolCalls,)


def syntax_for(chat_template: str | None) -> HermesToolCalls | None:
    """The tool-call syntax a chat template uses, if treadle knows it."""
    for syntax in SYNTAXES:
        if chat_template and syntax.matches(chat_template):
            return syntax()
    return None


class ToolCallStream:
    """One choice's text, fed as it streams: content and complete tool calls, in order."""

    def __init__(self, syntax: HermesToolCalls) -> None:
        self.syntax = syntax
        self.pending = ""  # text that may be (the start of) a call
        self.num_calls_sent = 0  # calls a stream has sent (their delta index)
        self.after_call = False  # the newlines that separate calls are not content

    def feed(self, text: str) -> list[str | ToolCall]:
        self.pending += text
        events: list[str | ToolCall] = []
        start, end = self.syntax.start, self.syntax.end
        while self.pending:
            if self.after_call:
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.after_call = False
            at = self.pending.find(start)
            if at < 0:  # no call begins here: all but a possible start of one is content
                keep = _partial_suffix(self.pending, start)
                if len(self.pending) > keep:
                    events.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                break
            if at > 0:
                events.append(self.pending[:at])
                self.pending = self.pending[at:]
            close = self.pending.find(end)
            if close < 0:
                break  # inside a call: wait for its end
            body = self.pending[len(start) : close].strip()
            call = self.syntax.parse_call(body)
            events.append(call if call is not None else self.pending[: close + len(end)])
            self.after_call = call is not None
            self.pending = self.pending[close + len(end) :]
        return [e for e in events if not (isinstance(e, str) and e == "")]

    def finish(self) -> list[str | ToolCall]:
        """What is left when the choice ends: an unfinished call is returned as text."""
        rest, self.pending = self.pending, ""
        return [rest] if rest else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_calls(syntax: HermesToolCalls, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer: its content (the text outside calls) and its calls."""
    stream = ToolCallStream(syntax)
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]
