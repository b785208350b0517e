"""Chat templates: the model's own Jinja template, rendered the way transformers renders it, but bounded.

Templates come from model files, so they are untrusted code. They run in Jinja's immutable sandbox
(no attribute access to Python internals, no mutation of passed objects), under three bounds:
a deadline on render time (checked by a trace hook, so even a loop that prints nothing is stopped),
a cap on the rendered size, and a cap on the size of strings and lists built by `*`.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateError

MAX_RENDER_SECONDS = 1.0
MAX_RENDER_CHARS = 4_000_000
_MAX_PRODUCT_ITEMS = 1_000_000
_MAX_INT_BITS = 1 << 16  # ~20,000 digits, past the 4,300 Python prints; a bigger int is an attack
_EVENTS_PER_CLOCK_CHECK = 512


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
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
