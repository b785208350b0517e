"""Ollama's API through the official `ollama` client and LangChain's `ChatOllama`: chat and generate,
streamed (NDJSON) and not, the listing routes, `format` with a pydantic model's schema, options, tools,
thinking, and errors in Ollama's shape — on the default model and the tiny thinking model."""

from __future__ import annotations

import json

import httpx
import ollama
import pydantic
import pytest

from app.ollama_protocol import OllamaFormatter
from app.tools import HermesToolCalls
from decoding.engine.outputs import FinishReason, RequestOutput, Usage
from tests.conftest_server import API_KEY, shared_server
from tests.reliability import running_server
from tests.template_models import chat_model
from tests.thinking_models import qwen3_thinking_model

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def main():
    server = shared_server("main")
    return server, ollama.Client(host=server.base_url, timeout=120)


def test_chat_whole_and_streamed_say_the_same_with_ollamas_fields(main):
    _, client = main
    whole = client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.eval_count >= 1 and whole.prompt_eval_count >= 0 and whole.total_duration > 0
    assert whole.eval_duration > 0 and whole.prompt_eval_duration > 0 and whole.load_duration == 0
    parts = list(client.chat(model=MODEL, messages=HELLO, options=GREEDY, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_the_stream_is_ndjson_one_object_per_line(main):
    server, _ = main
    with httpx.stream("POST", server.base_url + "/api/chat", timeout=120,
                      json={"model": MODEL, "messages": HELLO, "options": {"num_predict": 4}}) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"] and lines[-1]["done_reason"] == "length"


def test_generate_with_the_template_and_raw(main):
    _, client = main
    answer = client.generate(model=MODEL, prompt="Name a colour.", system="Answer in one word.", options=GREEDY)
    assert answer.done and answer.response
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options={"num_predict": 3,
                                                                                              "temperature": 0})
    assert raw.response and raw.eval_count == 3 and raw.done_reason == "length"
    loading = client.generate(model=MODEL, prompt="")  # how Ollama's clients load a model
    assert loading.done and loading.done_reason == "load"


def test_list_show_ps_and_version_describe_the_served_model(main):
    server, client = main
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size > 50_000_000 and listed.details.format == "gguf"
    assert listed.details.family == "llama" and listed.details.parameter_size.endswith("M")
    assert listed.details.quantization_level == "Q4_1"  # the file's own type (SmolLM2-135M-Instruct.Q4_1.gguf)
    shown = client.show(MODEL + ":latest")
    assert "completion" in shown.capabilities and "<|im_start|>" in shown.template
    assert shown.modelinfo["llama.context_length"] > 0
    (running,) = client.ps().models
    assert running.model == MODEL
    assert httpx.get(server.base_url + "/api/version", timeout=30).json()["version"]


def test_format_holds_the_answer_to_a_pydantic_models_schema(main):
    _, client = main

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str
        population: int

    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "A city as JSON."}], stream=False,
                        format=City.model_json_schema(), options={"temperature": 0, "num_predict": 60})  # fmt: skip
    City.model_validate_json(reply.message.content)
    plain = client.chat(model=MODEL, messages=HELLO, format="json", options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(plain.message.content), dict)


def test_options_are_mapped_refused_or_named_as_ignored(main):
    server, client = main
    response = httpx.post(server.base_url + "/api/chat", timeout=120, json={
        "model": MODEL, "messages": HELLO, "stream": False, "options": {"num_predict": 2, "num_thread": 4}})
    assert response.status_code == 200 and "num_thread" in response.headers["warning"]
    assert response.json()["eval_count"] == 2
    for options, param in (({"mirostat": 2}, "mirostat"), ({"num_ctx": 10**7}, "num_ctx")):
        with pytest.raises(ollama.ResponseError) as failure:
            client.chat(model=MODEL, messages=HELLO, options=options, stream=False)
        assert failure.value.status_code == 400 and param in failure.value.error


def test_errors_are_in_ollamas_shape(main):
    server, client = main
    with pytest.raises(ollama.ResponseError) as failure:
        client.chat(model="llama3.2", messages=HELLO, stream=False)
    assert failure.value.status_code == 404 and "llama3.2" in failure.value.error
    response = httpx.post(server.base_url + "/api/chat", json={"model": MODEL, "messages": "hi"}, timeout=30)
    assert response.status_code == 400 and set(response.json()) == {"error"}
    pulled = httpx.post(server.base_url + "/api/pull", json={"model": "qwen3"}, timeout=30)
    assert pulled.status_code == 501 and "treadle pull" in pulled.json()["error"]
    guarded = shared_server("guarded")
    assert httpx.get(guarded.base_url + "/api/tags", timeout=30).status_code == 401
    keyed = ollama.Client(host=guarded.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert keyed.list().models


def test_a_call_in_the_answer_reaches_ollamas_shape_whole_and_streamed():
    """The model's Hermes call text becomes Ollama's tool_calls (arguments as an object, each call sent
    whole once written), content apart; the real Qwen2.5-Coder calls tools on its own through the API
    in tests/test_real_architectures.py."""
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    last = RequestOutput("r", 0, text=text[40:], finish_reason=FinishReason.STOP, usage=Usage(5, 9))
    streamed = OllamaFormatter("m", True, HermesToolCalls())
    chunks = streamed.chunks(RequestOutput("r", 0, text=text[:40])) + streamed.chunks(last)
    calls = [c for chunk in chunks for c in chunk["message"].get("tool_calls", [])]
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert "".join(chunk["message"]["content"] for chunk in chunks) == "Sure."
    whole = OllamaFormatter("m", True, HermesToolCalls()).response([RequestOutput(
        "r", 0, text=text, finish_reason=FinishReason.STOP, usage=Usage(5, 9))])
    assert whole["message"]["tool_calls"] == calls and whole["message"]["content"] == "Sure."


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    directory = qwen3_thinking_model(tmp_path_factory.mktemp("ollama"), opens=True)
    with running_server(["--model", str(directory), "--kv-cache-mb", "32", "--default-thinking-budget", "6"]) as server:
        yield server, ollama.Client(host=server.base_url, timeout=120)


def test_thinking_and_tools_on_a_thinking_model(thinking):
    server, client = thinking
    model = "qwen3-thinking-2507"
    reply = client.chat(model=model, messages=HELLO, options={"num_predict": 20, "seed": 1}, stream=False)
    assert reply.message.thinking and reply.message.content  # the default budget ends the thinking
    parts = list(client.chat(model=model, messages=HELLO, options={"num_predict": 20, "seed": 1}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
    closed = client.chat(model=model, messages=HELLO, think=False, options={"num_predict": 5}, stream=False)
    assert not closed.message.thinking and closed.message.content
    shown = client.show(model)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    answer = client.chat(model=model, messages=HELLO, tools=[get_weather], options={"num_predict": 10}, stream=False)
    assert answer.done  # a random model calls nothing by itself: the tools reached its template
    rendered = httpx.post(server.base_url + "/tokenize", timeout=30, json={
        "messages": HELLO}).json()["count"]  # fmt: skip
    assert answer.prompt_eval_count > rendered  # the tools' descriptions are in the prompt
    from langchain_ollama import ChatOllama

    bound = ChatOllama(base_url=server.base_url, model=model, num_predict=10).bind_tools([get_weather])
    assert bound.invoke("What is the weather in Paris?").response_metadata["done"]


def test_langchain_chat_ollama_invokes_streams_and_structures_output(main):
    from langchain_ollama import ChatOllama

    server, _ = main
    chat = ChatOllama(base_url=server.base_url, model=MODEL, temperature=0, num_predict=24)
    reply = chat.invoke("Write one sentence about the sea.")
    streamed = "".join(chunk.content for chunk in chat.stream("Write one sentence about the sea."))
    assert reply.content and streamed == reply.content

    class Colour(pydantic.BaseModel):
        name: str

    structured = ChatOllama(base_url=server.base_url, model=MODEL, temperature=0, num_predict=40)
    colour = structured.with_structured_output(Colour, method="json_schema").invoke("Name a colour.")
    assert isinstance(colour, Colour)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    with pytest.raises(ollama.ResponseError) as refused:  # its template has no tool-call syntax: said, not ignored
        chat.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert refused.value.status_code == 400 and "tool-call syntax" in refused.value.error


def test_the_clients_own_types_take_every_field_we_send(main):
    """Whole answers and every NDJSON line parse into the `ollama` package's types with no field left over."""
    server, _ = main
    body = {"model": MODEL, "messages": HELLO, "options": {"num_predict": 4}}
    whole = httpx.post(server.base_url + "/api/chat", json={**body, "stream": False}, timeout=120).json()
    with httpx.stream("POST", server.base_url + "/api/chat", json=body, timeout=120) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    generated = httpx.post(server.base_url + "/api/generate", timeout=120, json={
        "model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}).json()  # fmt: skip
    for value, kind in [(whole, ollama.ChatResponse), *((line, ollama.ChatResponse) for line in lines),
                        (generated, ollama.GenerateResponse)]:  # fmt: skip
        parsed = kind.model_validate(value)
        assert set(value) <= set(type(parsed).model_fields), set(value) - set(type(parsed).model_fields)
    tags = httpx.get(server.base_url + "/api/tags", timeout=30).json()
    listed = ollama.ListResponse.model_validate(tags).models[0]
    assert set(tags["models"][0]) <= set(type(listed).model_fields) | {"name"}


def test_a_suffix_fills_in_the_middle_with_the_models_fim_tokens(tmp_path):
    """Continue's autocomplete: /api/generate with a suffix (and /v1/completions' `suffix`) asks a code
    model for the middle, `<|fim_prefix|>` prefix `<|fim_suffix|>` suffix `<|fim_middle|>`, ended by its
    FIM end tokens; a model without them is a 400. The real Qwen2.5-Coder fills code in
    tests/test_real_architectures.py."""
    tags = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")  # 376-379
    directory = chat_model("qwen2", tmp_path / "qwen2-fim", None, tags, special=True)
    with running_server(["--model", str(directory), "--kv-cache-mb", "16"]) as server:
        prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
        ids = httpx.post(server.base_url + "/tokenize", json={"prompt": prefix}, timeout=30).json()["tokens"]
        suffix_ids = httpx.post(server.base_url + "/tokenize", json={"prompt": suffix}, timeout=30).json()["tokens"]
        client = ollama.Client(host=server.base_url, timeout=120)
        answer = client.generate(model="qwen2-fim", prompt=prefix, suffix=suffix, options={"num_predict": 4})
        assert answer.done and answer.prompt_eval_count == len(ids) + len(suffix_ids) + 3
        ended = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "prompt": prefix, "suffix": suffix, "max_tokens": 8, "logit_bias": {"379": 100}}).json()  # <|fim_pad|>
        assert ended["choices"][0]["finish_reason"] == "stop" and ended["choices"][0]["stop_reason"] == 379
    main = shared_server("main")  # a model not trained to fill in the middle
    refused = httpx.post(main.base_url + "/v1/completions", json={"prompt": "a", "suffix": "b"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"
