"""OpenAI's Responses API over HTTP with the official `openai` client: whole and streamed answers, their
typed events, background runs polled and streamed from `starting_after`, cancel, stored conversations
continued with previous_response_id, text.format, and what is refused."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from .conftest_server import TreadleServer, shared_server

MODEL = "smollm2-135m-instruct"
POEM = "Write a long poem about the sea."


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_whole_response_matches_the_chat_answer_to_the_same_messages(client):
    response = client.responses.create(model=MODEL, input="Name three colours.", instructions="Answer briefly.",
                                       max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert client.responses.retrieve(response.id).output_text == response.output_text  # stored


def test_a_stream_sends_the_typed_events_in_order_and_they_add_up_to_the_response(client):
    events = list(client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=40,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          types[-1]] and types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text and final.usage.output_tokens > 0
    assert final.output[0].id == done.item_id


def test_a_background_response_is_polled_and_streamed_from_starting_after(client):
    created = client.responses.create(model=MODEL, input=POEM, max_output_tokens=96, temperature=0,
                                      background=True, extra_body={"ignore_eos": True})
    assert created.status in ("queued", "in_progress") and created.background
    polled = client.responses.retrieve(created.id)
    assert polled.status in ("queued", "in_progress", "incomplete")
    events = list(client.responses.retrieve(created.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in events] == list(range(4, 4 + len(events)))
    assert events[-1].type == "response.incomplete"  # max_output_tokens, ignore_eos
    final = client.responses.retrieve(created.id)
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 96
    # what the stream from 4 on adds to the events before it is the whole text
    all_events = list(client.responses.retrieve(created.id, stream=True))
    assert all_events[4:] == events
    text = "".join(e.delta for e in all_events if e.type == "response.output_text.delta")
    assert text == final.output_text


def test_a_background_response_can_be_cancelled_and_only_a_background_one(client):
    created = client.responses.create(model=MODEL, input=POEM, max_output_tokens=2000, background=True,
                                      extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(created.id).status == "cancelled"
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)


def test_previous_response_id_continues_the_stored_conversation(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    # the prompt is the whole conversation: exactly what the chat template makes of it
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()
    assert second.usage.input_tokens == tokens["count"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Describe Paris as JSON.", max_output_tokens=80,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                       "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True, "store": False}, "store"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
])
def test_what_cannot_be_honoured_is_refused_by_name(server, fields, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    answer = httpx.post(f"{server.base_url}/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith(param)


@pytest.mark.parametrize("tools", [5026, True, 1.5, "web_search", {"type": "web_search"}])
def test_tools_that_are_not_a_list_are_a_400_naming_them(server, tools):
    """Found by the schemathesis fuzz: a number in `tools` was iterated and answered 500."""
    answer = httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, "input": "Hi", "tools": tools})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith("tools")


def test_unknown_ids_are_404_and_bad_queries_400(server):
    base = f"{server.base_url}/v1/responses"
    assert httpx.get(f"{base}/resp_missing").status_code == 404
    assert httpx.post(f"{base}/resp_missing/cancel").status_code == 404
    created = httpx.post(base, json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).json()
    assert httpx.get(f"{base}/{created['id']}", params={"stream": "maybe"}).status_code == 400
    assert httpx.delete(f"{base}/{created['id']}").json()["deleted"] is True
    assert httpx.get(f"{base}/{created['id']}").status_code == 404


def test_a_streamed_response_cut_mid_answer_resumes_from_its_last_sequence_number(client, server):
    kwargs = {"model": MODEL, "input": POEM, "max_output_tokens": 64, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = client.responses.create(**kwargs)
    http = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = http.responses.create(stream=True, **kwargs)
    head = []
    for event in stream:
        head.append(event)
        if len(head) == 8:
            break
    stream.close()
    http.close()  # the connection is gone mid-answer
    time.sleep(0.2)
    rest = list(client.responses.retrieve(head[0].response.id, stream=True, starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
