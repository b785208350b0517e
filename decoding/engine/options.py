"""Options declared once: a dataclass field's default, help and check, read by everything that sets it.

`option(...)` declares a field of a configuration dataclass (`EngineConfig`, the server's settings):
its default, a help text and a parser that turns command-line or environment text into a value and
checks it. The same parser checks values given in code (`check_options`, from `__post_init__`), the
command line and the environment are built from the declarations (app/settings.py), and so is the
option table of docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

Parser = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class OptionSpec:
    help: str
    parse: Parser  # text (or an already typed value) → the value; raises ValueError saying why not
    flag: str | None = None  # default: --field-name, or --no-field-name for a switch that is on by default
    doc_default: str | None = None  # how the docs table says the default, where its value does not read well
    many: bool = False  # several values (a tuple): space-separated in the environment


def option(default: Any, help: str, parse: Parser = str, *, flag: str | None = None, doc_default: str | None = None,
           many: bool = False) -> Any:
    """A dataclass field declared as an option (`default` may be a tuple; it is immutable)."""
    spec = OptionSpec(help, parse, flag, doc_default, many)
    return field(default=default, metadata={"option": spec})


def option_fields(cls: type) -> list[tuple[Field[Any], OptionSpec]]:
    return [(f, f.metadata["option"]) for f in fields(cls) if "option" in f.metadata]


def default_of(f: Field[Any]) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def flag_of(f: Field[Any], spec: OptionSpec) -> str:
    if spec.flag is not None:
        return spec.flag
    name = f.name.replace("_", "-")
    return f"--no-{name}" if default_of(f) is True else f"--{name}"


def check_options(instance: Any) -> None:
    """Every option of a configuration passes its own parser: a bad value given in code is refused
    with the same words as on the command line."""
    for f, spec in option_fields(type(instance)):
        value = getattr(instance, f.name)
        if value is None or isinstance(value, bool):
            continue
        try:
            if spec.many:
                for item in value:
                    spec.parse(item)
            else:
                spec.parse(value)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{f.name}: {exc}") from None


# ---- parsers: each takes text or a typed value -------------------------------------------------------


def positive_int(value: Any) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(f"must be at least 1, got {number}")
    return number


def non_negative_int(value: Any) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(f"must be zero or more, got {number}")
    return number


def int_between(low: int, high: int) -> Parser:
    def parse(value: Any) -> int:
        number = int(value)
        if not low <= number <= high:
            raise ValueError(f"must be between {low} and {high}, got {number}")
        return number

    return parse


def positive_float(value: Any) -> float:
    number = float(value)
    if not number > 0:
        raise ValueError(f"must be positive, got {value}")
    return number


def non_negative_float(value: Any) -> float:
    number = float(value)
    if not number >= 0:
        raise ValueError(f"must be zero or more, got {value}")
    return number


def float_above(low: float) -> Parser:
    def parse(value: Any) -> float:
        number = float(value)
        if not number > low:
            raise ValueError(f"must be more than {low:g}, got {value}")
        return number

    return parse


def port(value: Any) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise ValueError(f"not a TCP port: {number}")
    return number


def one_of(choices: Sequence[str], lower: bool = False) -> Parser:
    def parse(value: Any) -> str:
        text = str(value).lower() if lower else str(value)
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return text

    return parse


def or_none(parse: Parser) -> Parser:
    """`none` (any case) for None, else `parse`."""

    def parse_or_none(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        return parse(value)

    return parse_or_none


def or_auto(parse: Parser) -> Parser:
    def parse_or_auto(value: Any) -> Any:
        return "auto" if value == "auto" else parse(value)

    return parse_or_auto


def comma_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, tuple):
        return value
    return tuple(item.strip() for item in str(value).split(",") if item.strip())


def switch(value: Any) -> bool:
    """An environment variable's on/off text."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"must be 1/0, true/false, yes/no or on/off, got {value!r}")
