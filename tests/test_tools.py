"""Tool calling through a real server and the official `openai` client.

The model is the tiny random qwen2 of tests/golden/architectures with a Hermes-style chat template
(Qwen2.5's tool syntax): a random model calls no tool by itself, so `tool_choice` "required" and a
named function are what is tested here — the output is constrained to the call syntax with
arguments valid against each function's schema — plus the parser on text a model writes, and the
400s. The real Qwen2.5-Coder calls tools on its own in tests/test_real_architectures.py (slow).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from app.tools import HermesToolCalls, ToolCall, ToolCallStream, split_calls
from tests.reliability import running_server
from tests.test_architectures import GOLDEN

# Qwen2.5's template, shortened: tools in the system turn, calls and responses in its tags
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}  # fmt: skip
NO_ARGS = {"type": "function", "function": {"name": "roll_die"}}
TOOLS = [WEATHER, TIME, NO_ARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0}) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def hermes_model(parent: Path, tag_tokens: bool = False) -> Path:
    """The tiny random qwen2 model with HERMES_TEMPLATE and room in its context for the tools; with
    `tag_tokens`, `<tool_call>` and `</tool_call>` are tokens of their own (as in Qwen2.5)."""
    directory = parent / ("qwen2-hermes-tags" if tag_tokens else "qwen2-hermes")
    shutil.copytree(GOLDEN / "qwen2", directory)
    if tag_tokens:
        tokenizer = json.loads((directory / "tokenizer.json").read_text())
        first = len(tokenizer["model"]["vocab"])
        tokenizer["added_tokens"] += [{"id": first + i, "content": tag, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": False}
                                      for i, tag in enumerate(("<tool_call>", "</tool_call>"))]  # fmt: skip
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    model_config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 4096}))
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--model", str(hermes_model(tmp_path_factory.mktemp("hermes"))), "--kv-cache-mb", "32"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tool_choice_required_answers_with_valid_calls(client, seed):
    completion = client.chat.completions.create(model="qwen2-hermes", messages=ASK, tools=TOOLS, seed=seed,
                                                tool_choice="required", parallel_tool_calls=False,
                                                temperature=1.0, max_tokens=200)  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"})


def test_parallel_calls_are_each_valid(client):
    """A random model may go on calling until max_tokens: every complete call is still valid, and an
    unfinished last one stays text (finish_reason length)."""
    for seed in range(3):
        completion = client.chat.completions.create(model="qwen2-hermes", messages=ASK, tools=TOOLS, seed=seed,
                                                    tool_choice="required", temperature=1.0, max_tokens=300)  # fmt: skip
        choice = completion.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        check_calls(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"})
        assert (choice.finish_reason == "length") == bool(choice.message.content)


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client):
    for seed in range(3):
        completion = client.chat.completions.create(
            model="qwen2-hermes", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)  # fmt: skip
        calls = completion.choices[0].message.tool_calls
        assert len(calls) == 1
        check_calls(calls, {"get_time"})


def test_streamed_calls_arrive_in_openais_delta_shape(client):
    for seed in range(4):
        stream = client.chat.completions.create(model="qwen2-hermes", messages=ASK, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, seed=seed, max_tokens=300, stream=True)  # fmt: skip
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or part.id
                entry["name"] = entry["name"] or (part.function.name if part.function else None)
                entry["arguments"] += (part.function.arguments or "") if part.function else ""
        assert finish in ("tool_calls", "length") and calls
        assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... for parallel calls
        for entry in calls.values():
            assert entry["id"].startswith("call_")
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_a_conversation_with_calls_and_their_results_goes_back_to_the_template(client):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]  # fmt: skip
    completion = client.chat.completions.create(model="qwen2-hermes", messages=messages, tools=TOOLS, max_tokens=5)
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_is_a_plain_chat(client):
    completion = client.chat.completions.create(model="qwen2-hermes", messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=5, temperature=0)  # fmt: skip
    assert completion.choices[0].message.tool_calls is None


REFUSED = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools", "no parameters"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", ""),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "why"), REFUSED, ids=[r[1] + ":" + r[2] for r in REFUSED])
def test_tool_requests_that_cannot_be_served_are_400s(server, fields, param, why):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": ASK, "max_tokens": 4, **fields})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and why in error["message"], error


def test_a_model_whose_template_has_no_tool_syntax_refuses_tools():
    with running_server(["--model", str(GOLDEN / "qwen2"), "--kv-cache-mb", "16"]) as server:
        response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                              json={"messages": ASK, "tools": TOOLS, "max_tokens": 4})  # fmt: skip
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text


def test_the_parser_splits_streamed_text_into_content_and_calls_at_any_boundary():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call> Done <tool_ca')  # fmt: skip
    whole_content, whole_calls = split_calls(HermesToolCalls(), text)
    assert whole_content == "Let me check.  Done <tool_ca"
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    for size in (1, 2, 3, 7, 11):
        stream = ToolCallStream(HermesToolCalls())
        events = []
        for i in range(0, len(text), size):
            events += stream.feed(text[i : i + size])
        events += stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert content == whole_content and [c.name for c in calls] == ["get_weather", "get_time"]


def test_a_broken_call_is_returned_as_text_not_lost():
    content, calls = split_calls(HermesToolCalls(), "<tool_call>\nnot json\n</tool_call>")
    assert calls == [] and content == "<tool_call>\nnot json\n</tool_call>"


def test_under_auto_a_call_the_model_begins_gets_valid_arguments(tmp_path):
    """Where the opening tag is a token of its own, drawing it attaches the call's grammar until the
    call ends, then the text is free again. A logit bias makes the random model open calls; without
    the grammar what followed the tag would be noise."""
    directory = hermes_model(tmp_path, tag_tokens=True)
    with running_server(["--model", str(directory), "--kv-cache-mb", "32"]) as server:
        opening = httpx.post(server.base_url + "/tokenize", json={"prompt": "<tool_call>"}, timeout=30).json()
        assert len(opening["tokens"]) == 1
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        for seed in range(3):
            choice = client.chat.completions.create(
                model="qwen2-hermes-tags", messages=ASK, tools=TOOLS, tool_choice="auto", seed=seed, temperature=1.0,
                max_tokens=150, logit_bias={str(opening["tokens"][0]): 100}).choices[0]  # fmt: skip
            check_calls(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"})
