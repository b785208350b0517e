"""The tool-call syntaxes of Llama 3.x (JSON), Mistral (`[TOOL_CALLS]`) and Qwen3-Coder (XML): parsed at
every split of the stream, constrained by grammar under `required` and a named function, begun under
`auto` through their opening token, streamed as OpenAI's deltas and sent back through each template.

The model is the tiny random qwen2 of tests/golden/architectures with a template written in each
family's shape (shortened), its tags added to the vocabulary as tokens of their own.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from app.tool_syntaxes import Llama3JsonToolCalls, MistralToolCalls, Qwen3CoderToolCalls, syntax_for
from app.tools import HermesToolCalls, split_calls
from tests.reliability import running_server
from tests.template_models import chat_model
from tests.test_tools import ASK, SCHEMAS, TOOLS

LLAMA3_TEMPLATE = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Respond with a JSON for a function call:
{"name": function name, "parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
{%- endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}{# builtin tools answer after <|python_tag|> #}"""

MISTRAL_TEMPLATE = """{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}{% if message.role == "user" %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == "user" %}{% if loop.index0 == ns.last_user and tools %}[AVAILABLE_TOOLS]
{{- tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == "assistant" and message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}{% if call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}
{%- if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>
{%- endif %}
{%- endfor %}"""

QWEN3_CODER_TEMPLATE = """{%- if tools %}<|im_start|>system
You have these functions:
<tools>
{%- for tool in tools %}
<function><name>{{ tool.function.name }}</name></function>
{%- endfor %}
</tools>
Call one as:
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{%- for key, value in call.function.arguments.items() %}
<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{%- endfor %}
</function>
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

FAMILIES = {
    "llama3_json": (LLAMA3_TEMPLATE, ("<|python_tag|>",), Llama3JsonToolCalls),
    "mistral": (MISTRAL_TEMPLATE, ("[TOOL_CALLS]",), MistralToolCalls),
    "qwen3_coder": (QWEN3_CODER_TEMPLATE, ("<tool_call>", "</tool_call>"), Qwen3CoderToolCalls),
}
FUNCTIONS = [t["function"] for t in TOOLS]


def family_model(parent: Path, family: str) -> Path:
    template, tags, _ = FAMILIES[family]
    return chat_model("qwen2", parent / f"qwen2-{family}", template, tags, special=True)


# ---- the parsers ----------------------------------------------------------------------------------------

WEATHER_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})
DIE_CALL = ("roll_die", {})
TEXTS = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "roll_die", "parameters": {}}', "", [WEATHER_CALL, DIE_CALL]),
        ('<|python_tag|>{"name": "roll_die", "parameters": {}}', "", [DIE_CALL]),
        ('{"parameters": {}, "name": "roll_die"}', "", [DIE_CALL]),  # another key order: sent whole
        ("It is 4.", "It is 4.", []),
        ('{"answer": 4}', '{"answer": 4}', []),  # an object that is not a call is content
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "roll_die", "arguments": {}}]', "", [WEATHER_CALL, DIE_CALL]),
        ('Let me check.[TOOL_CALLS][{"name": "roll_die", "arguments": {}}]', "Let me check.", [DIE_CALL]),
        ("No tools: [brackets] stay.", "No tools: [brackets] stay.", []),
    ],
    "qwen3_coder": [
        ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
         "celsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=roll_die>\n</function>\n"
         "</tool_call>", "Sure.\n", [WEATHER_CALL, DIE_CALL]),
        ("<tool_call>\nnot a call\n</tool_call> after", "<tool_call>\nnot a call\n</tool_call> after", []),
    ],
}


def pieces_of(text: str):
    """`text` whole, cut once everywhere, and cut twice at a stride (the cuts that matter are all seen)."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, len(text), 7), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("family", list(TEXTS))
def test_each_syntax_splits_content_and_calls_the_same_at_every_boundary(family):
    syntax = FAMILIES[family][2](FUNCTIONS)
    for text, content, calls in TEXTS[family]:
        whole_content, whole_calls = split_calls(syntax, text)
        assert whole_content == content, text
        assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls, text
        for pieces in pieces_of(text):
            stream = syntax.stream()
            events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
            streamed_content = "".join(e for e in events if isinstance(e, str))
            arguments: dict[int, str] = {}
            names: dict[int, str] = {}
            for event in events:
                if isinstance(event, dict):
                    names[event["index"]] = event["function"].get("name", names.get(event["index"]))
                    arguments[event["index"]] = arguments.get(event["index"], "") + event["function"]["arguments"]
            assert streamed_content == content, pieces
            assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls, pieces


def test_the_template_picks_the_syntax_and_the_option_overrides_it():
    for family, (template, _, cls) in FAMILIES.items():
        assert type(syntax_for(template)) is cls, family
    assert type(syntax_for(QWEN3_CODER_TEMPLATE, "hermes")) is HermesToolCalls
    assert syntax_for("{{ messages }}") is None
    ids = {MistralToolCalls().new_call_id() for _ in range(20)}
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(ids) == 20


def test_qwen3_coder_values_follow_the_parameters_schema():
    syntax = Qwen3CoderToolCalls([{"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}}}}])  # fmt: skip
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\n42\n</parameter>\n"
            '<parameter=o>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>')
    _, (call,) = split_calls(syntax, text)
    assert json.loads(call.arguments) == {"n": 42, "s": "42", "o": {"a": [1]}}


# ---- through a server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_client(request, tmp_path_factory):
    directory = family_model(tmp_path_factory.mktemp(request.param), request.param)
    with running_server(["--model", str(directory), "--kv-cache-mb", "32"]) as server:
        yield request.param, openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                           timeout=120)  # fmt: skip


def check(calls, allowed: set[str], finish_reason: str = "tool_calls") -> None:
    """Valid calls of allowed functions; under max_tokens the last may stop where the answer did."""
    assert calls, "no call"
    for i, call in enumerate(calls):
        assert call.function.name in allowed
        if finish_reason == "length" and i == len(calls) - 1:
            continue
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_are_valid_whole_and_streamed(family_client):
    family, client = family_client
    model = f"qwen2-{family}"
    for seed in range(3):
        choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, seed=seed, temperature=1.0,
                                                max_tokens=200).choices[0]  # fmt: skip
        assert choice.finish_reason == "tool_calls", choice
        check(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"})
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named, seed=1,
                                            temperature=1.0, max_tokens=200).choices[0]  # fmt: skip
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    check(choice.message.tool_calls, {"get_time"})
    if family == "mistral":
        assert all(len(c.id) == 9 for c in choice.message.tool_calls)
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, seed=1, temperature=1.0, max_tokens=200,
        stream=True) if chunk.choices]  # fmt: skip
    parts = [part for d in deltas for part in d.tool_calls or []]
    assert parts[0].function.name == "get_time" and parts[0].id
    assert "".join(p.function.arguments or "" for p in parts) == choice.message.tool_calls[0].function.arguments
    # the call and its result go back through the template (Mistral's refuses ids not 9 long)
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "12:00"}]
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=3)
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_under_auto_the_opening_token_attaches_the_calls_grammar(family_client):
    family, client = family_client
    opening = FAMILIES[family][1][0]
    opening_id = 376  # the first added token
    for seed in range(2):
        choice = client.chat.completions.create(
            model=f"qwen2-{family}", messages=ASK, tools=TOOLS, tool_choice="auto", seed=seed, temperature=1.0,
            max_tokens=150, logit_bias={str(opening_id): 100}).choices[0]  # fmt: skip
        check(choice.message.tool_calls, {"get_weather", "get_time", "roll_die"}, choice.finish_reason)
        assert opening not in (choice.message.content or "")
