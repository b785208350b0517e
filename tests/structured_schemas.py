"""JSON schemas for the structured-output tests: nested objects, arrays with bounds, enums, patterns,
bounded numbers, anyOf / oneOf, $ref and $defs, required and optional fields, const, nullable values.
Strings carry a maxLength (or a pattern or enum) so that a sampled answer ends within the test's
max_tokens: a truncated answer is not valid JSON, and the tests would rightly fail on it."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 24}
SHORT = {"type": "string", "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SCORE = {"type": "number", "minimum": 0, "maximum": 1}
COLOR = {"type": "string", "enum": ["red", "green", "blue"]}
DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
EMAIL = {"type": "string", "pattern": r"^[a-z]{1,10}@[a-z]{1,10}\.(com|org)$"}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **extra}  # fmt: skip


def closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return obj(properties, required, additionalProperties=False)


SCHEMAS: list[dict[str, Any]] = [
    # flat objects
    closed({"name": NAME}),
    closed({"name": NAME, "age": AGE}),
    closed({"name": NAME, "age": AGE, "email": EMAIL}),
    closed({"title": SHORT, "done": {"type": "boolean"}}),
    closed({"x": {"type": "integer"}, "y": {"type": "integer"}}),
    closed({"score": SCORE, "label": SHORT}),
    closed({"color": COLOR}),
    closed({"color": COLOR, "shade": {"type": "integer", "minimum": 1, "maximum": 9}}),
    closed({"when": DATE, "what": SHORT}),
    closed({"id": {"type": "integer", "minimum": 1000, "maximum": 9999}, "ok": {"type": "boolean"}}),
    # optional fields
    closed({"name": NAME, "nickname": SHORT}, required=["name"]),
    closed({"a": SHORT, "b": SHORT, "c": SHORT}, required=[]),
    closed({"city": SHORT, "zip": {"type": "string", "pattern": r"^\d{5}$"}}, required=["city"]),
    closed({"count": {"type": "integer", "minimum": 0, "maximum": 50}, "unit": COLOR}, required=["count"]),
    # numbers with bounds
    closed({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    closed({"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    closed({"n": {"type": "integer", "minimum": -5, "maximum": 5},
            "m": {"type": "integer", "minimum": 10, "maximum": 12}}),
    closed({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}}),
    # arrays with bounds
    closed({"tags": {"type": "array", "items": SHORT, "maxItems": 3}}),
    closed({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 2}}),
    closed({"points": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                       "maxItems": 4}}),
    closed({"matrix": {"type": "array", "maxItems": 2,
                       "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "minItems": 2, "maxItems": 2}}}),
    closed({"colors": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3}}),
    {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": closed({"k": SHORT, "v": {"type": "integer", "minimum": 0, "maximum": 99}}),
     "maxItems": 2},
    # nested objects
    closed({"person": closed({"name": NAME, "age": AGE})}),
    closed({"person": closed({"name": NAME, "address": closed({"city": SHORT, "zip": {"type": "string",
                                                                                         "pattern": r"^\d{5}$"}})})}),
    closed({"meta": closed({"version": {"type": "integer", "minimum": 1, "maximum": 9}, "draft": {"type": "boolean"}}),
            "body": SHORT}),
    closed({"a": closed({"b": closed({"c": closed({"d": {"type": "integer", "minimum": 0, "maximum": 9}})})})}),
    closed({"team": SHORT,
            "members": {"type": "array", "maxItems": 2, "items": closed({"name": NAME, "role": COLOR})}}),
    # enums and const
    closed({"answer": {"enum": ["yes", "no"]}}),
    closed({"level": {"enum": [1, 2, 3]}, "name": SHORT}),
    closed({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}}),
    closed({"mixed": {"enum": ["a", 1, True, None]}}),
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    # patterns
    closed({"hex": {"type": "string", "pattern": r"^#[0-9a-f]{6}$"}}),
    closed({"code": {"type": "string", "pattern": r"^[A-Z]{3}-\d{3}$"}}),
    closed({"phone": {"type": "string", "pattern": r"^\+\d{2} \d{3} \d{4}$"}}),
    closed({"slug": {"type": "string", "pattern": r"^[a-z]+(-[a-z]+){0,2}$", "maxLength": 30}}),
    # anyOf / oneOf / nullable
    closed({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, SHORT]}}),
    closed({"value": {"anyOf": [{"type": "null"}, NAME]}}),
    closed({"shape": {"anyOf": [closed({"r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                                closed({"w": {"type": "integer", "minimum": 1, "maximum": 9},
                                        "h": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    closed({"id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                             {"type": "string", "pattern": r"^id\d$"}]}}),
    closed({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    # $ref and $defs
    {"$defs": {"person": closed({"name": NAME, "age": AGE})}, **closed({"owner": {"$ref": "#/$defs/person"}})},
    {"$defs": {"pt": closed({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                             "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
     **closed({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    {"$defs": {"color": COLOR}, **closed({"fg": {"$ref": "#/$defs/color"}, "bg": {"$ref": "#/$defs/color"}})},
    {"$defs": {"item": closed({"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 5}})},
     **closed({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}})},
    # open objects (additional properties allowed), booleans, top-level scalars
    obj({"name": SHORT}, additionalProperties={"type": "integer", "minimum": 0, "maximum": 9}, maxProperties=3),
    closed({"flags": closed({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}})}),
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "boolean"},
    # something like a real tool's parameters
    closed({"location": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1,
                                                                                        "maximum": 7}},
           required=["location"]),
    closed({"query": NAME, "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            "filters": {"type": "array", "items": SHORT, "maxItems": 2}}, required=["query"]),
]
