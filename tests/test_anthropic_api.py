"""Anthropic's Messages API through the official `anthropic` client and LangChain's `ChatAnthropic`:
whole and streamed answers, the typed events, count_tokens, tool use with its round trip, thinking,
and errors in Anthropic's shape — on the default model and on the tiny thinking model with Hermes tags
(tests/thinking_models.py), which calls tools when told to."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from bench.sse import SSEDecoder
from tests.conftest_server import API_KEY, shared_server
from tests.reliability import running_server
from tests.thinking_models import qwen3_thinking_model

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}  # fmt: skip


@pytest.fixture(scope="module")
def main():
    server = shared_server("main")
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    return server, client, "smollm2-135m-instruct"


def test_a_whole_message_and_its_stream_say_the_same(main):
    server, client, model = main
    whole = client.messages.create(model=model, max_tokens=24, messages=HELLO, extra_body={"temperature": 0})
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens >= 1 and whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 10
    with client.messages.stream(model=model, max_tokens=24, messages=HELLO, extra_body={"temperature": 0}) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_the_stream_is_anthropics_typed_events_each_with_its_event_line(main):
    server, _, model = main
    body = {"model": model, "max_tokens": 8, "messages": HELLO, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=120,
                      headers={"anthropic-version": "2023-06-01"}) as response:  # fmt: skip
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        decoder = SSEDecoder()
        datas = [data for chunk in response.iter_raw() for data in decoder.feed(chunk)]
    types = [json.loads(d)["type"] for d in datas]
    assert decoder.event_types == types
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}


def test_thinking_on_a_model_that_does_not_think_is_kept_trivially(main):
    """Claude Code sends `thinking` whatever the model: a model that does not think is within any budget."""
    _, client, model = main
    message = client.messages.create(model=model, max_tokens=6, messages=HELLO, output_config={"effort": "low"},
                                     thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    assert [b.type for b in message.content] == ["text"]


def test_stop_sequences_and_count_tokens(main):
    server, client, model = main
    whole = client.messages.create(model=model, max_tokens=40, messages=HELLO, extra_body={"temperature": 0})
    word = whole.content[0].text.split()[2]
    cut = client.messages.create(model=model, max_tokens=40, messages=HELLO, stop_sequences=[word],
                                 extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word and word not in cut.content[0].text
    counted = client.messages.count_tokens(model=model, messages=HELLO, system="Be brief.")
    tokenized = httpx.post(server.base_url + "/tokenize", timeout=30, json={
        "messages": [{"role": "system", "content": "Be brief."}, *HELLO]}).json()["count"]  # fmt: skip
    assert counted.input_tokens == tokenized


@pytest.mark.parametrize(("fields", "error", "status"), [
    ({"max_tokens": None}, anthropic.BadRequestError, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, anthropic.BadRequestError, 400),
    ({"model": "claude-sonnet-4"}, anthropic.NotFoundError, 404),
    ({"messages": [*HELLO, {"role": "assistant", "content": "The sea"}]}, anthropic.BadRequestError, 400),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, anthropic.BadRequestError, 400),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, anthropic.BadRequestError, 400),
], ids=["no max_tokens", "image", "unknown model", "prefill", "mcp servers", "server tool"])
def test_errors_are_in_anthropics_shape(main, fields, error, status):
    server, client, model = main
    body = {"model": model, "max_tokens": 4, "messages": HELLO, **fields}
    raw = httpx.post(server.base_url + "/v1/messages", json={k: v for k, v in body.items() if v is not None},
                     timeout=30)  # fmt: skip
    assert raw.status_code == status and raw.json()["type"] == "error", raw.text
    expected_type = "not_found_error" if status == 404 else "invalid_request_error"
    assert raw.json()["error"]["type"] == expected_type and raw.json()["error"]["message"]
    if body["max_tokens"] is None:
        return  # the SDK itself refuses to send it
    known = {k: body.pop(k) for k in ("model", "max_tokens", "messages")}
    with pytest.raises(error) as failure:
        client.messages.create(**known, extra_body=body)
    assert failure.value.body["error"]["type"] == expected_type


def test_an_api_key_is_taken_as_x_api_key_and_a_wrong_one_is_an_authentication_error():
    server = shared_server("guarded")
    good = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    assert good.messages.create(model="smollm2-135m-instruct", max_tokens=2, messages=HELLO).content
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as failure:
        bad.messages.create(model="smollm2-135m-instruct", max_tokens=2, messages=HELLO)
    assert failure.value.body["error"]["type"] == "authentication_error"


# ---- tools and thinking ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    directory = qwen3_thinking_model(tmp_path_factory.mktemp("anthropic"), opens=True)
    with running_server(["--model", str(directory), "--kv-cache-mb", "32", "--default-thinking-budget", "8"]) as server:
        yield server, anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_tool_use_round_trip(thinking):
    server, client = thinking
    model = "qwen3-thinking-2507"
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    message = client.messages.create(model=model, max_tokens=200, messages=ask, tools=[WEATHER],
                                     extra_body={"temperature": 1.0},
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     thinking={"type": "enabled", "budget_tokens": 6})  # fmt: skip
    assert message.stop_reason == "tool_use"
    kinds = [b.type for b in message.content]
    assert kinds[0] == "thinking" and kinds[-1] == "tool_use" and kinds.count("tool_use") == 1
    call = message.content[-1]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    answer = client.messages.create(model=model, max_tokens=5, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(model=model, max_tokens=200, messages=ask, tools=[WEATHER],
                                extra_body={"temperature": 1.0},
                                tool_choice={"type": "tool", "name": "get_weather"},
                                thinking={"type": "enabled", "budget_tokens": 4}) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert {"thinking_delta", "input_json_delta"} <= deltas
    assert final.content[-1].type == "tool_use" and final.stop_reason == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])


def test_langchain_chat_anthropic_invokes_streams_and_binds_tools(thinking):
    from langchain_anthropic import ChatAnthropic

    server, _ = thinking
    chat = ChatAnthropic(base_url=server.base_url, api_key="unused", model="qwen3-thinking-2507", max_tokens=40,
                         temperature=1.0, max_retries=0, default_request_timeout=120)  # fmt: skip
    reply = chat.invoke("Hello")
    assert reply.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    chunks = list(chat.stream("Hello"))
    assert chunks
    bound = ChatAnthropic(base_url=server.base_url, api_key="unused", model="qwen3-thinking-2507", max_tokens=200,
                          temperature=1.0, max_retries=0).bind_tools([WEATHER], tool_choice="any")  # fmt: skip
    called = bound.invoke("Weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(called.tool_calls[0]["args"], WEATHER["input_schema"])
    import pydantic

    class City(pydantic.BaseModel):
        """A city."""

        # no other keys: with them allowed a random model may write keys until max_tokens cuts the JSON
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=12)

    structured = ChatAnthropic(base_url=server.base_url, api_key="unused", model="qwen3-thinking-2507",
                               max_tokens=200, temperature=0.0, max_retries=0).with_structured_output(City)  # fmt: skip
    assert isinstance(structured.invoke("Name a city."), City)


def test_the_sdks_own_types_take_every_field_we_send(main):
    """Each whole message and each stream event parses into the SDK's types with no field left over
    (a field the SDK does not know is one a client never reads); the route is counted in the metrics."""
    import pydantic
    from anthropic.types import Message, RawMessageStreamEvent

    server, _, model = main

    def leftovers(value) -> list[str]:
        if isinstance(value, pydantic.BaseModel):
            extra = [f"{type(value).__name__}.{k}" for k in (value.model_extra or {})]
            return extra + [x for field in type(value).model_fields for x in leftovers(getattr(value, field))]
        if isinstance(value, list):
            return [x for item in value for x in leftovers(item)]
        return []

    body = {"model": model, "max_tokens": 6, "messages": HELLO, "temperature": 0}
    before = server.metrics().get('treadle_route_requests_total{route="/v1/messages"}', 0)
    whole = httpx.post(server.base_url + "/v1/messages", json=body, timeout=120).json()
    assert leftovers(Message.model_validate(whole)) == []
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, timeout=120) as response:
        decoder = SSEDecoder()
        events = [json.loads(d) for chunk in response.iter_raw() for d in decoder.feed(chunk)]
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    assert [x for e in events if e["type"] != "ping" for x in leftovers(adapter.validate_python(e))] == []
    assert server.metrics()['treadle_route_requests_total{route="/v1/messages"}'] == before + 2
