"""Tool calling through a real server and the official `openai` client.

The model is the tiny random qwen2 of tests/golden/architectures with a Hermes-style chat template
(Qwen2.5's tool syntax): a random model calls no tool by itself, so `tool_choice` "required" and a
named function are what is tested here — the output is constrained to the call syntax with
arguments valid against each function's schema — plus the parser on text a model writes, and the
400s. The real Qwen2.5-Coder calls tools on its own in tests/test_real_architectures.py (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from app.tools import HermesToolCalls, ToolCallStream, split_calls
from tests.reliability import running_server
from tests.template_models import ARCHITECTURES, chat_model

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
                                       "properties": {"zone": {"type": "string",
                                                               "pattern": "^[A-Z]{3}$"}}}}}  # fmt: skip
NO_ARGS = {"type": "function", "function": {"name": "roll_die"}}
TOOLS = [WEATHER, TIME, NO_ARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def hermes_model(parent: Path, tag_tokens: bool = False) -> Path:
    """The tiny random qwen2 model with HERMES_TEMPLATE and room in its context for the tools; with
    `tag_tokens`, `<tool_call>` and `</tool_call>` are tokens of their own (as in Qwen2.5)."""
    directory = parent / ("qwen2-hermes-tags" if tag_tokens else "qwen2-hermes")
    return chat_model("qwen2", directory, HERMES_TEMPLATE, ("<tool_call>", "</tool_call>") if tag_tokens else ())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--model", str(hermes_model(tmp_path_factory.mktemp("hermes"))),
                         "--kv-cache-mb", "32"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, allowed: set[str], finish_reason: str = "tool_calls") -> None:
    """Every call names an allowed function with valid arguments; an answer cut by max_tokens may end in
    a call whose arguments stop where the answer did (as OpenAI's do)."""
    assert calls
    for i, call in enumerate(calls):
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in allowed
        if finish_reason == "length" and i == len(calls) - 1:
            continue
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
    """A random model may go on calling until max_tokens: every complete call is still valid (an
    unfinished last one keeps the arguments written, finish_reason length)."""
    for seed in range(3):
        completion = client.chat.completions.create(model="qwen2-hermes", messages=ASK, tools=TOOLS, seed=seed,
                                                    tool_choice="required", temperature=1.0,
                                                    max_tokens=300)  # fmt: skip
        choice = completion.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        check_calls(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"}, choice.finish_reason)


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client):
    for seed in range(3):
        completion = client.chat.completions.create(
            model="qwen2-hermes", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)  # fmt: skip
        calls = completion.choices[0].message.tool_calls
        assert len(calls) == 1
        check_calls(calls, {"get_time"})


def test_a_named_function_is_called_exactly_once_whatever_parallel_tool_calls_says(client):
    """vLLM's meaning of a named tool_choice: one call of that function. parallel_tool_calls is left at its
    default (true) here; the random model would go on calling until max_tokens if the grammar let it."""
    for seed in range(3):
        completion = client.chat.completions.create(
            model="qwen2-hermes", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=300,
            tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_time"})


def test_streamed_calls_arrive_in_openais_delta_shape(client):
    for seed in range(4):
        stream = client.chat.completions.create(model="qwen2-hermes", messages=ASK, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, seed=seed, max_tokens=300, stream=True)  # fmt: skip
        calls: dict[int, dict] = {}
        firsts: dict[int, object] = {}
        fragments: dict[int, int] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            for part in delta.tool_calls or []:
                first = part.index not in firsts
                firsts.setdefault(part.index, part)
                assert (part.id is not None) == first and (part.function.name is not None) == first
                fragments[part.index] = fragments.get(part.index, 0) + 1
                entry = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
                entry["arguments"] += part.function.arguments
        assert finish in ("tool_calls", "length") and calls
        assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... for parallel calls
        assert all(firsts[i].type == "function" and firsts[i].function.arguments == "" for i in firsts)
        assert max(fragments.values()) > 2  # arguments stream as they are written, not in one piece
        for index, entry in calls.items():
            assert entry["id"].startswith("call_")
            if not (finish == "length" and index == len(calls) - 1):  # else cut where the answer was
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


FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape


def test_the_responses_api_calls_functions_whole_and_streamed(client):
    for seed in range(3):
        response = client.responses.create(model="qwen2-hermes", input="What is the weather in Paris?",
                                           tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
                                           temperature=1.0, max_output_tokens=200, extra_body={"seed": seed})
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        if response.status == "completed":
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        events = list(client.responses.create(model="qwen2-hermes", input="What is the weather in Paris?",
                                              tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
                                              temperature=1.0, max_output_tokens=200, stream=True,
                                              extra_body={"seed": seed}))
        added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        final = events[-1].response.output[-1]
        assert len(added) == 1 and added[0].item.arguments == "" and len(deltas) > 2
        assert "".join(deltas) == done.arguments == final.arguments == call.arguments  # seeded: the same call


def test_the_responses_api_takes_calls_and_their_outputs_as_input_items(client):
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "unit": "celsius"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"}]
    response = client.responses.create(model="qwen2-hermes", input=items, tools=FLAT_TOOLS, max_output_tokens=5)
    without_output = client.responses.create(model="qwen2-hermes", input=items[:2], tools=FLAT_TOOLS,
                                             max_output_tokens=5)
    assert response.usage.input_tokens > without_output.usage.input_tokens  # the output reached the prompt


def test_logprobs_with_tools_cover_every_token_content_and_calls_whole_and_streamed(client):
    """vLLM's way: logprobs.content lists every generated token, those that spell the calls too, in
    order; a stream sends the same entries (each with the chunk its text first appears in, or the
    last chunk), so that they add up to the whole answer's."""
    ask = dict(model="qwen2-hermes", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
               max_tokens=120, logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**ask)
    entries = whole.choices[0].logprobs.content
    assert whole.choices[0].message.tool_calls and len(entries) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    spelled = "".join(e.token for e in entries)
    assert whole.choices[0].message.tool_calls[0].function.name in spelled
    streamed = [e for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices
                for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


REFUSED = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools", "no parameters"),
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
    with running_server(["--model", str(ARCHITECTURES / "qwen2"), "--kv-cache-mb", "16"]) as server:
        response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                              json={"messages": ASK, "tools": TOOLS, "max_tokens": 4})  # fmt: skip
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text


def test_the_parser_splits_streamed_text_into_content_and_calls_at_any_boundary():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {\\"}"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "at": [1, {"h": 2}]}}\n</tool_call>'
            ' Done <tool_ca')  # fmt: skip
    whole_content, whole_calls = split_calls(HermesToolCalls(), text)
    assert whole_content == "Let me check.  Done <tool_ca"
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == [
        ("get_weather", {"city": 'Paris {"}'}), ("get_time", {"zone": "CET", "at": [1, {"h": 2}]})]
    for size in (1, 2, 3, 7, 11):
        stream = ToolCallStream(HermesToolCalls())
        events = []
        for i in range(0, len(text), size):
            events += stream.feed(text[i : i + size])
        events += stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        assert content == whole_content
        deltas = [e for e in events if isinstance(e, dict)]
        for index, call in enumerate(whole_calls):
            mine = [d for d in deltas if d["index"] == index]
            assert mine[0]["function"] == {"name": call.name, "arguments": ""} and mine[0]["type"] == "function"
            assert all("id" not in d and "name" not in d["function"] for d in mine[1:])
            assert "".join(d["function"]["arguments"] for d in mine) == call.arguments
            if size < 7:
                assert len(mine) > 3  # the arguments came in fragments, as they were written


def test_a_call_cut_by_max_tokens_keeps_its_name_and_the_arguments_written():
    content, calls = split_calls(HermesToolCalls(), 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert content == "Sure " and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"ci')]
    content, calls = split_calls(HermesToolCalls(), 'Sure <tool_call>\n{"name": "get_wea')
    assert content == 'Sure <tool_call>\n{"name": "get_wea' and calls == []  # no name yet: not a call


def test_a_call_in_another_key_order_is_sent_whole():
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    stream = ToolCallStream(HermesToolCalls())
    events = [e for i in range(len(text)) for e in stream.feed(text[i])] + stream.finish()
    assert len(events) == 1 and events[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert events[0]["index"] == 0 and events[0]["id"].startswith("call_")


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
            check_calls(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"}, choice.finish_reason)
