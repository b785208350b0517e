"""Chat templates: the model's own Jinja template, rendered the way transformers renders it, but bounded.

Templates come from model files, so they are untrusted code. They run in Jinja's immutable sandbox
(no attribute access to Python internals, no mutation of passed objects), under these bounds:
a deadline on render time (checked by a trace hook, so even a loop that prints nothing is stopped),
a cap on the rendered size, and — because one C call (a join, a replace, a padded format) can build
gigabytes before the deadline is next checked — a size check before every operation that can grow a
string far beyond its inputs: `*`, `%`, `str.format`, padding and the join, replace, center, indent
and format filters.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import filters as jinja_filters
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateError

MAX_RENDER_SECONDS = 1.0
MAX_RENDER_CHARS = 4_000_000
_MAX_PRODUCT_ITEMS = 1_000_000
_MAX_INT_BITS = 1 << 16  # ~20,000 digits, past the 4,300 Python prints; a bigger int is an attack
_EVENTS_PER_CLOCK_CHECK = 512


# widths and precisions in %-formats ("%3000000000s") and format specs ("{:>3000000000}")
_FORMAT_NUMBERS = re.compile(r"(\d+)")
_PADDING_METHODS = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs"])


def _check_size(num_chars: int, what: str) -> None:
    if num_chars > MAX_RENDER_CHARS:
        raise TemplateError(f"chat template {what} would build more than {MAX_RENDER_CHARS} characters")


def _check_format_string(fmt: str) -> None:
    """A format string may pad to any width in one C call: refuse widths past the output cap."""
    if "*" in fmt and "%" in fmt:
        raise TemplateError("chat template used a '*' width in a % format")
    for number in _FORMAT_NUMBERS.findall(fmt):
        if len(number) > 7 or int(number) > MAX_RENDER_CHARS:
            raise TemplateError("chat template formatted with an oversized width or precision")


def _total_chars(items: Any) -> int:
    return sum(len(item) if isinstance(item, str) else len(str(item)) for item in items)


def _bounded_join(context: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)
    values = [jinja_filters.make_attrgetter(context.environment, attribute)(i) for i in items] if attribute else items
    _check_size(_total_chars(values) + len(d) * len(values), "joined strings that")
    return jinja_filters.sync_do_join(context, items, d, attribute)


def _bounded_replace(context: Any, s: str, old: str, new: str, count: int | None = None) -> str:
    s = str(s)
    occurrences = s.count(str(old)) if old else len(s) + 1
    if count is not None:
        occurrences = min(occurrences, max(count, 0))
    _check_size(len(s) + occurrences * max(0, len(str(new)) - len(str(old))), "replace")
    return jinja_filters.do_replace(context.eval_ctx, s, old, new, count)


def _bounded_center(value: str, width: int = 80) -> str:
    _check_size(int(width), "center")
    return jinja_filters.do_center(value, width)


def _bounded_indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    pad = width if isinstance(width, str) else " " * min(int(width), MAX_RENDER_CHARS + 1)
    _check_size(len(str(s)) + (str(s).count("\n") + 1) * len(pad), "indent")
    return jinja_filters.do_indent(s, width, first, blank)


def _bounded_format(value: str, *args: Any, **kwargs: Any) -> str:
    _check_format_string(str(value))
    return jinja_filters.do_format(value, *args, **kwargs)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "%"])

    def wrap_str_format(self, value: Any) -> Any:
        # Jinja wraps str.format at attribute access (so `call` never sees it): check the spec there.
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format_string(value.__self__)
        return wrapped

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _PADDING_METHODS and args and isinstance(args[0], int):
                _check_size(args[0] * (8 if name == "expandtabs" else 1) + len(owner), name)
            elif name == "join" and args:
                items = list(args[0])
                _check_size(_total_chars(items) + len(owner) * len(items), "joined strings that")
                args = (items, *args[1:])
            elif name == "replace" and len(args) >= 2:
                old, new = str(args[0]), str(args[1])
                occurrences = owner.count(old) if old else len(owner) + 1
                _check_size(len(owner) + occurrences * max(0, len(new) - len(old)), "replace")
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%":
            if isinstance(left, str):
                _check_format_string(left)
            return left % right
        # Big-int arithmetic runs in one C call that holds the GIL, where the deadline cannot stop it:
        # (((10 ** 64) ** 64) ** 64) ** 64 computes for ~40 s with every exponent within bounds.
        is_int_pair = isinstance(left, int) and isinstance(right, int)
        if operator == "**":
            if isinstance(right, int) and abs(right) > 64:
                raise TemplateError("chat template raised a number to a huge power")
            if is_int_pair and abs(left).bit_length() * right > _MAX_INT_BITS:
                raise TemplateError("chat template raised a number to a huge power")
            return left**right
        if is_int_pair and abs(left).bit_length() + abs(right).bit_length() > _MAX_INT_BITS:
            raise TemplateError("chat template multiplied huge numbers")
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                if len(seq) * count > _MAX_PRODUCT_ITEMS:
                    raise TemplateError("chat template built an oversized string or list")
                if isinstance(seq, (list, tuple)):  # the items' text counts too: [big] * 3000 | join
                    _check_size(_total_chars(seq) * count, "repeated a list that")
        return left * right


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' own tojson: keeps non-ASCII text as is (Jinja's built-in escapes it for HTML)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["join"] = jinja2.pass_context(_bounded_join)
    env.filters["replace"] = jinja2.pass_context(_bounded_replace)
    env.filters["center"] = _bounded_center
    env.filters["indent"] = _bounded_indent
    env.filters["format"] = _bounded_format
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _Deadline:
    """A trace hook that stops the rendering thread once it runs past its time budget."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.events = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        self.events += 1
        if self.events % _EVENTS_PER_CLOCK_CHECK == 0 and time.monotonic() > self.deadline:
            raise TemplateError(f"chat template took longer than {MAX_RENDER_SECONDS:g} s to render")
        return self


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from None
        self.source = source
        self._special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        variables = {**self._special_tokens, **extra, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        previous = sys.gettrace()
        sys.settrace(_Deadline(MAX_RENDER_SECONDS))
        try:
            return self._render_bounded(variables)
        except TemplateError:
            raise
        except RecursionError:
            raise TemplateError("chat template recursed too deeply") from None
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"chat template tried something unsafe: {exc}") from None
        except Exception as exc:  # a template is code: any of its failures is the template's fault
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            sys.settrace(previous)

    def _render_bounded(self, variables: dict[str, Any]) -> str:
        pieces: list[str] = []
        size = 0
        for piece in self._template.generate(**variables):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise TemplateError(f"chat template rendered more than {MAX_RENDER_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
