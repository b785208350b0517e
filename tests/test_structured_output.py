"""Structured output: every constrained answer matches its constraint.

In process: a corpus of JSON schemas (tests/structured_schemas.py), each sampled at temperature 1
with several seeds, every answer parsed and validated with `jsonschema`; regexes, choices and a Lark
grammar; the JSON layout (no free whitespace, bounded digit runs); batch invariance. Over HTTP, with
the official `openai` client: response_format (`parse` with a pydantic model, streamed), vLLM's
structured_outputs and guided_* fields, n > 1, and the 400s for what cannot be compiled or combined.

What a sampled answer must be holds on any CPU; which answer a seed draws does not (numba compiles
for the host, so rounding, and with it a draw, differs between CPUs). So a constraint whose every
answer is bounded (bounded strings, lists, digit runs; no recursion) must end with `stop` within
max_tokens; an unbounded one (free-form JSON, a recursive grammar) may end with `length`, and then
what was written must still be a start the constraint can continue (`check_answer`).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest

from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.engine.structured import MAX_NUMBER_DIGITS, Constraint, Guide
from tests.conftest_server import TreadleServer, shared_server
from tests.structured_schemas import SCHEMAS

SEEDS = (0, 1, 2)
PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(default_model):
    engine = Engine(default_model, EngineConfig(kv_cache_mb=256, max_num_seqs=64, max_queue=1024)).start()
    yield engine
    engine.shutdown()


def generate(engine, constraint: Constraint, seeds=SEEDS, max_tokens=300, prompt=PROMPT,
             temperature=1.0) -> list[tuple[str, str]]:  # fmt: skip
    """(text, finish_reason) of each seed, all submitted together so that they share steps."""
    ids = engine.model.tokenizer.encode(prompt)
    streams = [engine.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                 constraint=constraint)) for seed in seeds]  # fmt: skip
    results = []
    for stream in streams:
        outputs = list(stream)
        results.append(("".join(o.text for o in outputs), outputs[-1].finish_reason))
    return results


def check_answer(guide: Guide, constraint: Constraint, text: str, reason: str) -> None:
    """A whole answer (`stop`) the constraint accepts, or one cut by max_tokens (`length`) that it can
    still continue; in JSON's layout either way."""
    assert reason in ("stop", "length"), (reason, text)
    assert guide.text_state(constraint, text) == ("complete" if reason == "stop" else "prefix"), (reason, text)
    if constraint.kind.startswith("json"):
        assert not layout_violations(text), (layout_violations(text), text)


def layout_violations(text: str) -> list[str]:
    """Whitespace outside strings other than one space after ',' or ':', and digit runs past the bound."""
    problems, in_string, escaped, digits = [], False, False, 0
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string, digits = True, 0
            continue
        digits = digits + 1 if char.isdigit() else 0
        if digits > MAX_NUMBER_DIGITS:
            problems.append(f"a run of more than {MAX_NUMBER_DIGITS} digits at {i}")
        if char.isspace() and not (char == " " and i > 0 and text[i - 1] in ",:"):
            problems.append(f"free whitespace {char!r} at {i}")
    return problems


def test_the_corpus_has_at_least_50_valid_schemas():
    assert len(SCHEMAS) >= 50
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_schema_of_the_corpus_is_obeyed_at_temperature_1(engine):
    """Whole answers validate against their schema; answers cut by max_tokens are starts of one."""
    streams = [(schema, engine.submit(engine.model.tokenizer.encode(PROMPT), SamplingParams(
        max_tokens=300, temperature=1.0, seed=seed, constraint=Constraint("json", json.dumps(schema)))))
        for schema in SCHEMAS for seed in SEEDS]  # fmt: skip
    failures = []
    for schema, stream in streams:
        outputs = list(stream)
        text, reason = "".join(o.text for o in outputs), outputs[-1].finish_reason
        try:
            check_answer(engine.guide, Constraint("json", json.dumps(schema)), text, reason)
            if reason == "stop":
                jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{json.dumps(schema)[:80]} -> {text[:80]!r}: {str(exc)[:120]}")
    assert not failures, f"{len(failures)} of {len(streams)} answers invalid:\n" + "\n".join(failures[:5])


def test_any_json_object_is_an_object(engine):
    """Free-form JSON has no bound: a small model may keep adding keys until max_tokens (it does on some
    CPUs and not on others), so every answer is an object, or the start of one, in the layout."""
    prompt = ("<|im_start|>user\nGive a JSON object with the name and age of a person.<|im_end|>\n"
              "<|im_start|>assistant\n")
    constraint = Constraint("json_object")
    for text, reason in generate(engine, constraint, temperature=0.7, max_tokens=400, prompt=prompt):
        check_answer(engine.guide, constraint, text, reason)
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text


def test_check_answer_refuses_what_the_constraint_does_not_allow(engine):
    """The check above can fail: text outside the grammar, or a whole answer said to be cut, or a cut
    one said to be whole."""
    constraint = Constraint("json_object")
    for text, reason in [('{"a": 1}x', "stop"), ('{"a":1}', "stop"), ('{"a": 1}', "length"), ('{"a": ', "stop"),
                         ("[1", "length"), ('{"a": 1}', "abort")]:  # fmt: skip
        with pytest.raises(AssertionError):
            check_answer(engine.guide, constraint, text, reason)
    check_answer(engine.guide, constraint, '{"a": 1}', "stop")
    check_answer(engine.guide, constraint, '{"a": [1, ', "length")


def test_a_number_cannot_run_on_forever(engine):
    """An unbounded number is where a sampled JSON answer wanders off: its digit runs are bounded."""
    schema = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
              "required": ["x", "y"], "additionalProperties": False}  # fmt: skip
    for text, reason in generate(engine, Constraint("json", json.dumps(schema)), seeds=range(8), temperature=1.5):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert not layout_violations(text), text


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"#[0-9a-f]{6}", r"(yes|no), because [a-z ]{5,20}\.",
                                     r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"\d{4}-\d{2}-\d{2}",
                                     r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"])
def test_a_regex_is_matched_whole(engine, pattern):
    for text, reason in generate(engine, Constraint("regex", pattern), max_tokens=60):
        assert reason == "stop" and re.fullmatch(pattern, text), (pattern, text)


def test_a_choice_is_one_of_its_strings(engine):
    choices = ["positive", "negative", "neutral", "it depends"]
    results = generate(engine, Constraint("choice", json.dumps(choices)), seeds=range(8))
    assert all(reason == "stop" and text in choices for text, reason in results), results


def test_a_lark_grammar_is_followed(engine):
    grammar = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""
    constraint = Constraint("grammar", grammar)
    for text, reason in generate(engine, constraint, seeds=range(6), max_tokens=80):  # recursive: may be cut
        check_answer(engine.guide, constraint, text, reason)
        if reason == "length":
            continue
        assert re.fullmatch(r"[0-9+\-() ]+", text) and text.count("(") == text.count(")"), text
        eval(compile(text, "<answer>", "eval"), {"__builtins__": {}})  # noqa: S307 - digits, + - ( ) only


def test_a_constrained_answer_does_not_depend_on_its_batch(engine):
    schema = SCHEMAS[2]
    constraint = Constraint("json", json.dumps(schema))
    alone = generate(engine, constraint, seeds=(7,))[0]
    neighbours = threading.Thread(target=generate, args=(engine, Constraint("json_object")),
                                  kwargs={"seeds": range(10), "temperature": 0.9})  # fmt: skip
    neighbours.start()
    crowded = generate(engine, constraint, seeds=(7,))[0]
    neighbours.join()
    assert crowded == alone


# ---- over HTTP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")


@pytest.fixture(scope="module")
def client(server: TreadleServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


class Person(pydantic.BaseModel):
    """Every field bounded, so every answer ends within max_tokens whatever a seed draws."""

    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    languages: list[Annotated[str, pydantic.StringConstraints(max_length=16)]] = pydantic.Field(max_length=3)


def test_the_openai_clients_parse_returns_the_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id, response_format=Person, temperature=1.0, seed=3, max_tokens=500,
        messages=[{"role": "user", "content": "Invent a programmer and describe them."}],
    )  # fmt: skip
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person), message.content


def test_properties_come_in_the_schemas_order(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha", "mid"],
              "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}, "mid": {"enum": ["x", "y"]}}}
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Fill the form."}],
        response_format={"type": "json_schema", "json_schema": {"name": "form", "schema": schema}},
    )  # fmt: skip
    assert list(json.loads(completion.choices[0].message.content)) == ["zeta", "alpha", "mid"]


def test_a_streamed_json_schema_answer_validates(client):
    schema = SCHEMAS[29]  # a team with at most two members, every string bounded: it ends within max_tokens
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, stream=True, temperature=1.0, seed=5, max_tokens=300,
        messages=[{"role": "user", "content": "Describe a small team."}],
        response_format={"type": "json_schema", "json_schema": {"name": "team", "schema": schema, "strict": True}},
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_completions_take_vllms_structured_outputs_and_guided_fields(server, default_model):
    """Each constraint bounds its answers (they end with `stop`) but json_object, which may be cut."""
    cases = [({"structured_outputs": {"regex": r"\d{2}:\d{2}"}}, lambda t: re.fullmatch(r"\d{2}:\d{2}", t)),
             ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
             ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
             ({"guided_json": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
                               "additionalProperties": False}}, lambda t: isinstance(json.loads(t)["k"], int)),
             ({"structured_outputs": {"json": json.dumps({"type": "array", "items": {"type": "boolean"},
                                                          "maxItems": 3})}}, lambda t: isinstance(json.loads(t), list)),
             ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict))]  # fmt: skip
    guide = Guide.for_model(default_model)
    for fields, check in cases:
        body = {"prompt": "The answer:", "max_tokens": 120, "temperature": 0.8, "seed": 1, "n": 2, **fields}
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            if "response_format" in fields and choice["finish_reason"] == "length":
                check_answer(guide, Constraint("json_object"), choice["text"], "length")
                continue
            assert choice["finish_reason"] == "stop" and check(choice["text"]), (fields, choice)


REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "unclosed"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "give one"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "structured output"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "why"), REFUSED, ids=[r[1] + ":" + r[2] for r in REFUSED])
def test_what_cannot_be_compiled_or_combined_is_a_400_naming_the_field(server, fields, param, why):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and why in error["message"], error
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200  # still serving


def test_logprobs_of_a_constrained_answer_are_finite_json(server):
    """Tokens the grammar forbids have logprob -inf: reported as -9999.0 (as vLLM does), never as a
    non-JSON -Infinity or a 500 — with one token allowed, top_logprobs 5 holds four forbidden ones.
    Greedy: the likeliest start is a part of the word ("n"), whose rest is then the only token allowed;
    sampled, a whole-word first token (a few percent) ended the answer with no forced position."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 5,
            "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}  # fmt: skip
    response = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text
    values = [e["logprob"] for t in response.json()["choices"][0]["logprobs"]["content"] for e in t["top_logprobs"]]
    assert min(values) == -9999.0 and all(v <= 0 for v in values)
    body = {"prompt": "x", "max_tokens": 3, "logprobs": 5, "stream": True, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    for event in events:
        json.loads(event, parse_constant=lambda name, event=event: pytest.fail(f"{name} in {event}"))
