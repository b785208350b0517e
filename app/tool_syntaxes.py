"""The tool-call syntaxes of the other model families treadle loads, and the registry that picks one.

- Llama 3.1–3.3 (`llama3_json`): the answer is a call `{"name": ..., "parameters": {...}}`, written
  bare or after `<|python_tag|>`; several are separated by `; `.
- Mistral (`mistral`): `[TOOL_CALLS]` and a JSON list `[{"name": ..., "arguments": {...}}, ...]`; call
  ids are 9 letters and digits, which Mistral's templates require of the calls sent back.
- Qwen3-Coder (`qwen3_coder`): XML in Hermes' tags, one `<parameter=...>` per argument, its value as
  plain text (strings) or JSON (the rest):

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

Each streams OpenAI's deltas as the calls are written (a call's name, then its arguments), and gives
the grammars of a forced call and of a call begun under `auto`, as the Hermes syntax does (tools.py).
The template decides which syntax a model uses; `--tool-call-parser` (vLLM's names) overrides it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from decoding.engine.params import ToolCallTrigger
from decoding.engine.structured import Constraint

from .tools import (
    EMPTY_PARAMETERS,
    HermesToolCalls,
    JsonValueScanner,
    ToolSyntax,
    call_body_schema,
    partial_suffix,
    take_arguments,
)

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')


class JsonCallStream:
    """Calls written as JSON objects `{"name": ..., "arguments" | "parameters": {...}}` after an opening
    (`openings`; with `bare_start`, an object that begins the answer opens too). Between calls only
    `glue` may come (separators, brackets, whitespace, another opening); anything else is content
    again. A call whose body begins with its name streams its arguments as they are written; one in
    another key order is sent whole when it ends; an object that is not a call is content."""

    def __init__(self, syntax: ToolSyntax, openings: tuple[str, ...], glue: tuple[str, ...],
                 bare_start: bool = False) -> None:  # fmt: skip
        self.syntax = syntax
        self.openings = openings
        self.glue = glue
        self.bare_start = bare_start
        self.pending = ""
        self.num_calls = 0
        self.in_calls = False
        self.at_start = True  # nothing but whitespace seen yet
        self._arguments: JsonValueScanner | None = None
        self._closing = False  # the arguments are complete: the body's `}` is next

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        self.pending += text
        events: list[str | dict[str, Any]] = []
        while self.pending and self._step(events):
            pass
        return [e for e in events if e != ""]

    def _step(self, events: list[str | dict[str, Any]]) -> bool:
        """One move; False when more text is needed."""
        if self._arguments is not None:
            return self._stream_arguments(events)
        if self.in_calls:
            return self._between_calls(events)
        opening, at = self._find_opening()
        if at < 0:
            keep = max([partial_suffix(self.pending, o) for o in self.openings] + [0])
            if self.bare_start and self.at_start and not self.pending.strip():
                keep = len(self.pending)  # only whitespace so far: a bare call may still begin the answer
            events.append(self.pending[: len(self.pending) - keep])
            if self.pending[: len(self.pending) - keep].strip():
                self.at_start = False
            self.pending = self.pending[len(self.pending) - keep :]
            return False
        events.append(self.pending[:at])
        self.pending = self.pending[at + len(opening) :]
        self.in_calls, self.at_start = True, False
        return True

    def _find_opening(self) -> tuple[str, int]:
        found = [(self.pending.find(o), o) for o in self.openings if o in self.pending]
        if self.bare_start and self.at_start and self.pending.lstrip().startswith("{"):
            found.append((len(self.pending) - len(self.pending.lstrip()), ""))
        if not found:
            return "", -1
        at, opening = min(found)
        return opening, at

    def _between_calls(self, events: list[str | dict[str, Any]]) -> bool:
        rest = self.pending
        while True:
            stripped = rest.lstrip()
            glue = next((g for g in self.glue if stripped.startswith(g)), None)
            if glue is None:
                break
            rest = stripped[len(glue) :]
        rest = rest.lstrip()
        self.pending = rest
        if not rest:
            return False
        if rest.startswith("{"):
            return self._call(events)
        if any(g.startswith(rest) for g in self.glue):
            return False  # perhaps the start of a separator or tag
        self.in_calls = False  # text after the calls: content again
        return True

    def _call(self, events: list[str | dict[str, Any]]) -> bool:
        header = _HEADER.match(self.pending)
        if header is not None:
            events.append({"index": self.num_calls, "id": self.syntax.new_call_id(), "type": "function",
                           "function": {"name": json.loads(f'"{header.group(1)}"'), "arguments": ""}})  # fmt: skip
            self._arguments = JsonValueScanner()
            self.pending = self.pending[header.end() :]
            return True
        scanner = JsonValueScanner()
        taken = scanner.feed(self.pending)
        if not scanner.is_complete:
            return False  # a body in another form: sent whole once it ends
        body, self.pending = self.pending[:taken], self.pending[taken:]
        call = self.syntax.parse_call(body)
        if call is None:
            events.append(body)
            self.in_calls = False
        else:
            events.append({"index": self.num_calls, **call.as_openai()})
            self.num_calls += 1
        return True

    def _stream_arguments(self, events: list[str | dict[str, Any]]) -> bool:
        scanner = self._arguments
        assert scanner is not None
        if not scanner.is_complete:
            self.pending = take_arguments(scanner, self.pending, self.num_calls, events)
            if not scanner.is_complete:
                return False
        close = self.pending.find("}")
        if close < 0:
            return False
        self.pending = self.pending[close + 1 :]
        self._arguments = None
        self.num_calls += 1
        return True

    def finish(self) -> list[str | dict[str, Any]]:
        rest, self.pending = self.pending, ""
        if self._arguments is not None:  # cut inside its arguments: a call, cut where the answer was
            self._arguments = None
            self.num_calls += 1
            return []
        if self.in_calls and all(not rest.strip() or rest.strip() in g for g in self.glue):
            return []
        return [rest] if rest else []


class Llama3JsonToolCalls(ToolSyntax):
    """Llama 3.1–3.3: `{"name": ..., "parameters": {...}}` as the answer, bare or after `<|python_tag|>`."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    tags = (python_tag,)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return cls.python_tag in chat_template or ("<|start_header_id|>" in chat_template
                                                    and '"parameters"' in chat_template)  # fmt: skip

    def stream(self) -> JsonCallStream:
        return JsonCallStream(self, (self.python_tag,), (";", self.python_tag), bare_start=True)

    def _body(self, functions: list[dict[str, Any]]) -> str:
        return f"body: %json {json.dumps(call_body_schema(functions, 'parameters'))}\n"

    def constraint(self, functions: list[dict[str, Any]], parallel: bool,
                   tag_token_ids: dict[str, int | None]) -> Constraint:  # fmt: skip
        repeat = ' ("; " body)*' if parallel else ""
        return Constraint("grammar", f"start: body{repeat}\n" + self._body(functions), "tool_choice")

    def call_trigger(self, functions: list[dict[str, Any]],
                     tag_token_ids: dict[str, int | None]) -> ToolCallTrigger | None:  # fmt: skip
        opening = tag_token_ids.get(self.python_tag)
        if opening is None:
            return None
        return ToolCallTrigger(opening, Constraint("grammar", "start: body\n" + self._body(functions), "tools"))


class MistralToolCalls(ToolSyntax):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"
    opening = "[TOOL_CALLS]"
    tags = (opening,)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return cls.opening in chat_template

    def new_call_id(self) -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def stream(self) -> JsonCallStream:
        return JsonCallStream(self, (self.opening,), ("[", ",", "]", self.opening))

    def _list(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        repeat = ' (", " body)*' if parallel else ""
        return (f'calls: "[" body{repeat} "]"\n'
                f"body: %json {json.dumps(call_body_schema(functions, 'arguments'))}\n")  # fmt: skip

    def constraint(self, functions: list[dict[str, Any]], parallel: bool,
                   tag_token_ids: dict[str, int | None]) -> Constraint:  # fmt: skip
        start = f"start: {self._tag(self.opening, tag_token_ids)} calls\n"
        return Constraint("grammar", start + self._list(functions, parallel), "tool_choice")

    def call_trigger(self, functions: list[dict[str, Any]],
                     tag_token_ids: dict[str, int | None]) -> ToolCallTrigger | None:  # fmt: skip
        opening = tag_token_ids.get(self.opening)
        if opening is None:
            return None
        return ToolCallTrigger(opening, Constraint("grammar", "start: calls\n" + self._list(functions, True), "tools"))


class Qwen3CoderToolCalls(ToolSyntax):
    """Qwen3-Coder: `<tool_call>`, `<function=NAME>`, per argument `<parameter=KEY>` VALUE `</parameter>`,
    `</function>`, `</tool_call>`, each on its own line."""

    name = "qwen3_coder"
    start, end = "<tool_call>", "</tool_call>"
    tags = (start, end)

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        return "<function=" in chat_template

    def stream(self) -> XmlCallStream:
        return XmlCallStream(self)

    def parameters_of(self, name: str) -> dict[str, Any]:
        function = next((f for f in self.functions if f["name"] == name), None)
        return (function or {}).get("parameters") or EMPTY_PARAMETERS

    def _functions(self, functions: list[dict[str, Any]]) -> str:
        rules = [f"function: {' | '.join(f'function_{i}' for i in range(len(functions)))}"]
        for i, function in enumerate(functions):
            schema = function.get("parameters") or EMPTY_PARAMETERS
            required = set(schema.get("required", []))
            parts = []
            for j, (key, value_schema) in enumerate((schema.get("properties") or {}).items()):
                rules.append(f'param_{i}_{j}: "<parameter={key}>\\n" value_{i}_{j} "\\n</parameter>\\n"')
                rules.append(f"value_{i}_{j}: {_value_rule(value_schema)}")
                parts.append(f"param_{i}_{j}" if key in required else f"param_{i}_{j}?")
            rules.append(f'function_{i}: "<function={function["name"]}>\\n" {" ".join(parts)} "</function>"')
        return "\n".join(rules) + "\n"

    def constraint(self, functions: list[dict[str, Any]], parallel: bool,
                   tag_token_ids: dict[str, int | None]) -> Constraint:  # fmt: skip
        start, end = (self._tag(tag, tag_token_ids) for tag in (self.start, self.end))
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = f'start: call{repeat}\ncall: {start} "\\n" function "\\n" {end}\n' + self._functions(functions)
        return Constraint("grammar", lark, "tool_choice")

    def call_trigger(self, functions: list[dict[str, Any]],
                     tag_token_ids: dict[str, int | None]) -> ToolCallTrigger | None:  # fmt: skip
        opening = tag_token_ids.get(self.start)
        if opening is None:
            return None
        lark = f'start: "\\n" function "\\n" {self._tag(self.end, tag_token_ids)}\n' + self._functions(functions)
        return ToolCallTrigger(opening, Constraint("grammar", lark, "tools"))


def _is_text(schema: dict[str, Any]) -> bool:
    """The parameter's value is written as plain text: a string, or one of string choices."""
    if isinstance(schema.get("const"), str):
        return True
    return schema.get("type") == "string" or ("enum" in schema and all(isinstance(v, str) for v in schema["enum"]))


def _value_rule(schema: dict[str, Any]) -> str:
    """A parameter's value as Qwen3-Coder writes it: a string's text as is (no `<`, so the closing tag
    cannot hide in it), any other type as JSON."""
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if isinstance(schema.get("const"), str):
        return json.dumps(schema["const"])
    if schema.get("type") == "string" and isinstance(schema.get("pattern"), str):
        pattern = schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/")
        return f"/{pattern}/"
    if schema.get("type") == "string":
        longest = schema.get("maxLength")
        return f"/[^<]{{1,{int(longest)}}}/" if isinstance(longest, int) and longest >= 1 else "/[^<]+/"
    return f"%json {json.dumps(schema)}"


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?")


class XmlCallStream:
    """Qwen3-Coder's calls, streamed as OpenAI's deltas: the name when `<function=...>` is written, then
    each argument as `"key": value` once its `</parameter>` arrives, the object closed at `</function>`.
    A value is JSON where the function's schema says the parameter is not a string (and it parses),
    else a JSON string of the text. A block that is not such a call is content."""

    def __init__(self, syntax: Qwen3CoderToolCalls) -> None:
        self.syntax = syntax
        self.pending = ""
        self.num_calls = 0
        self._function: str | None = None  # the call being written
        self._num_arguments = 0
        self._after_call = False

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        self.pending += text
        events: list[str | dict[str, Any]] = []
        while self.pending and self._step(events):
            pass
        return [e for e in events if e != ""]

    def _step(self, events: list[str | dict[str, Any]]) -> bool:
        start, end = self.syntax.start, self.syntax.end
        if self._function is not None:
            return self._inside_function(events)
        if self._after_call:
            self.pending = self.pending.lstrip("\n")
            if not self.pending:
                return False
            self._after_call = False
        at = self.pending.find(start)
        if at < 0:
            keep = partial_suffix(self.pending, start)
            events.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return False
        events.append(self.pending[:at])
        self.pending = self.pending[at:]
        function = _FUNCTION.match(self.pending, len(start))
        if function is None:
            close = self.pending.find(end)
            if close < 0 and len(self.pending) < len(start) + 64:
                return False  # the function line may still come
            cut = close + len(end) if close >= 0 else len(start)
            events.append(self.pending[:cut])  # not a call: content
            self.pending = self.pending[cut:]
            return True
        self._function = function.group(1).strip()
        self._num_arguments = 0
        events.append({"index": self.num_calls, "id": self.syntax.new_call_id(), "type": "function",
                       "function": {"name": self._function, "arguments": ""}})  # fmt: skip
        self.pending = self.pending[function.end() :]
        return True

    def _inside_function(self, events: list[str | dict[str, Any]]) -> bool:
        if self._num_arguments < 0:
            close = self.pending.find(self.syntax.end)
            if close < 0:
                return False
            self.pending = self.pending[close + len(self.syntax.end) :]
            self._function = None
            self.num_calls += 1
            self._after_call = True
            return True
        stripped = self.pending.lstrip()
        if stripped.startswith("</function>"):
            events.append(self._fragment("}" if self._num_arguments else "{}"))
            self.pending = stripped[len("</function>") :]
            self._num_arguments = -1  # closed: only the end tag is left
            return True
        parameter = _PARAMETER.match(self.pending)
        if parameter is None:
            return False
        close = self.pending.find("</parameter>", parameter.end())
        if close < 0:
            return False
        key, raw = parameter.group(1).strip(), self.pending[parameter.end() : close]
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = self._value(key, raw)
        prefix = ", " if self._num_arguments else "{"
        events.append(self._fragment(f"{prefix}{json.dumps(key, ensure_ascii=False)}: {value}"))
        self._num_arguments += 1
        self.pending = self.pending[close + len("</parameter>") :]
        return True

    def _fragment(self, arguments: str) -> dict[str, Any]:
        return {"index": self.num_calls, "function": {"arguments": arguments}}

    def _value(self, key: str, raw: str) -> str:
        schema = (self.syntax.parameters_of(self._function or "").get("properties") or {}).get(key, {})
        if not _is_text(schema):
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False)
            except ValueError:
                pass
        return json.dumps(raw, ensure_ascii=False)

    def finish(self) -> list[str | dict[str, Any]]:
        rest, self.pending = self.pending, ""
        if self._function is not None:  # cut inside the call: its arguments so far (not valid JSON)
            self._function = None
            self.num_calls += 1
            return []
        return [rest] if rest else []


# The first whose template matches is the model's (Qwen3-Coder's template has Hermes' tags too).
SYNTAXES: tuple[type[ToolSyntax], ...] = (Qwen3CoderToolCalls, MistralToolCalls, Llama3JsonToolCalls,
                                          HermesToolCalls)  # fmt: skip
TOOL_CALL_PARSERS = ("auto", *(s.name for s in SYNTAXES))


def syntax_for(chat_template: str | None, parser: str = "auto",
               functions: list[dict[str, Any]] | None = None) -> ToolSyntax | None:  # fmt: skip
    """The tool-call syntax a chat template uses (or `parser`, vLLM's name, names), bound to `functions`."""
    for syntax in SYNTAXES:
        if syntax.name == parser or (parser == "auto" and chat_template and syntax.matches(chat_template)):
            return syntax(functions)
    return None
