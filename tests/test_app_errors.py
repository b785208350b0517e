"""Bad client input gets a 4xx with an OpenAI error body — never a 5xx, never a traceback."""

from __future__ import annotations

import json

import httpx
import msgpack
import pytest

from decoding import DEFAULT_MODEL as MODEL

from .conftest_server import TreadleServer, shared_server

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> bytes:
    return json.dumps({"messages": USER, "max_tokens": 1, **fields}).encode()


def completion(**fields: object) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 1, **fields}).encode()


# (id, path, body, expected status, expected `param` or None to skip that check)
CASES = [
    ("truncated json", CHAT, b'{"messages": [', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("json array", CHAT, b"[]", 400, None),
    ("json string", COMPLETIONS, b'"hi"', 400, None),
    ("NaN", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("lone surrogate", COMPLETIONS, b'{"prompt": "\\ud800"}', 400, None),
    ("deep nesting", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    ("messages missing", CHAT, b'{"max_tokens": 1}', 400, "messages"),
    ("messages empty", CHAT, chat(messages=[]), 400, "messages"),
    ("messages a string", CHAT, chat(messages="hi"), 400, "messages"),
    ("message without role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content"),
    ("prompt missing", COMPLETIONS, b'{"max_tokens": 1}', 400, "prompt"),
    ("prompt empty", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("prompt empty ids", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt negative id", COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    ("prompt id past vocab", COMPLETIONS, completion(prompt=[10**6]), 400, "prompt"),
    ("prompt list of strings", COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt"),
    ("prompt a number", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    ("prompt over the context", COMPLETIONS, completion(prompt=[1] * 9000), 400, "prompt"),
    ("chat over the context", CHAT, chat(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages"),
    ("max_tokens 0", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens a string", COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens a fraction", COMPLETIONS, completion(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens over the context", COMPLETIONS, completion(max_tokens=10**9), 400, "max_tokens"),
    ("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature huge", CHAT, chat(temperature=1000), 400, "temperature"),
    ("temperature a word", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top_p 0", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("top_p over 1", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("top_k -2", COMPLETIONS, completion(top_k=-2), 400, "top_k"),
    ("min_p 2", COMPLETIONS, completion(min_p=2), 400, "min_p"),
    ("repetition_penalty 0", COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition_penalty 50", COMPLETIONS, completion(repetition_penalty=50), 400, "repetition_penalty"),
    ("presence_penalty 3", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty -3", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("n 0", CHAT, chat(n=0), 400, "n"),
    ("n 1000", CHAT, chat(n=1000), 400, "n"),
    ("stop empty string", CHAT, chat(stop=""), 400, "stop"),
    ("stop too many", CHAT, chat(stop=[str(i) for i in range(100)]), 400, "stop"),
    ("stop a number", CHAT, chat(stop=[1]), 400, "stop"),
    ("seed a word", COMPLETIONS, completion(seed="x"), 400, "seed"),
    ("seed past 64 bits", COMPLETIONS, completion(seed=2**70), 400, "seed"),
    ("logit_bias key not an id", COMPLETIONS, completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias value huge", COMPLETIONS, completion(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit_bias id past vocab", COMPLETIONS, completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit_bias a list", COMPLETIONS, completion(logit_bias=[1]), 400, "logit_bias"),
    ("stop_token_ids past vocab", COMPLETIONS, completion(stop_token_ids=[10**7]), 400, None),
    ("chat logprobs a word", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("top_logprobs 50", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion logprobs 50", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("stream a word", CHAT, chat(stream="yes"), 400, "stream"),
    ("include_usage a word", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400, None),
    ("unknown model", CHAT, chat(model="gpt-4o"), 404, "model"),
    # as OpenAI: every message but the assistant's needs its content
    ("user message without content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0.content"),
    ("system content null", CHAT, chat(messages=[{"role": "system", "content": None}, *USER]), 400,
     "messages.0.content"),
    ("developer message without content", CHAT, chat(messages=[{"role": "developer"}, *USER]), 400,
     "messages.0.content"),
    ("tool message without content", CHAT, chat(messages=[*USER, {"role": "tool"}]), 400, "messages.1.content"),
    # as OpenAI and vLLM: stream_options only with stream: true
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream_options with stream false", COMPLETIONS, completion(stream=False, stream_options={}), 400,
     "stream_options"),
    ("min_tokens negative", COMPLETIONS, completion(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens a string", COMPLETIONS, completion(min_tokens="2"), 400, "min_tokens"),
    ("min_tokens over max_tokens", COMPLETIONS, completion(max_tokens=2, min_tokens=3), 400, "min_tokens"),
    ("min_tokens over the default max_tokens", COMPLETIONS, json.dumps({"prompt": "hi", "min_tokens": 17}).encode(),
     400, "min_tokens"),
    ("include_stop_str_in_output a word", CHAT, chat(include_stop_str_in_output="yes"), 400,
     "include_stop_str_in_output"),
    ("tokenize both inputs", "/tokenize", json.dumps({"prompt": "a", "messages": USER}).encode(), 400, None),
    ("tokenize no input", "/tokenize", b"{}", 400, None),
    ("detokenize negative id", "/detokenize", b'{"tokens": [-1]}', 400, None),
    ("detokenize id past vocab", "/detokenize", b'{"tokens": [1000000]}', 400, "tokens"),
    ("detokenize not a list", "/detokenize", b'{"tokens": "abc"}', 400, "tokens"),
]

MSGPACK_CASES = [
    ("truncated msgpack", msgpack.packb({"prompt": "hi"})[:-1]),
    ("trailing data", msgpack.packb({"prompt": "hi"}) + b"\x00"),
    ("msgpack list", msgpack.packb(["hi"])),
    ("integer keys", msgpack.packb({1: "hi"})),
    ("bytes prompt", msgpack.packb({"prompt": b"hi", "max_tokens": 1}, use_bin_type=True)),
    ("ext type", msgpack.packb({"prompt": msgpack.ExtType(5, b"x")})),
]


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(server, path, body, status, param):
    response = httpx.post(server.base_url + path, content=body, headers={"Content-Type": "application/json"},
                          timeout=60)
    error = assert_openai_error(response, status)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("body", [c[1] for c in MSGPACK_CASES], ids=[c[0] for c in MSGPACK_CASES])
def test_bad_msgpack_gets_a_400(server, body):
    response = httpx.post(server.base_url + COMPLETIONS, content=body, headers={"Content-Type": "application/msgpack"})
    assert_openai_error(response, 400)


def test_body_over_the_limit_gets_413_with_or_without_a_length(server):
    huge = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    assert_openai_error(httpx.post(server.base_url + COMPLETIONS, content=huge), 413)

    def chunked():  # no Content-Length: the limit must hold while reading
        for start in range(0, len(huge), 65536):
            yield huge[start : start + 65536]

    assert_openai_error(httpx.post(server.base_url + COMPLETIONS, content=chunked()), 413)


def test_unknown_route_and_wrong_method_get_openai_errors(server):
    assert_openai_error(httpx.get(server.base_url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.base_url + CHAT), 405)


def test_omitted_or_served_model_name_is_accepted(server):
    for model in (None, MODEL):
        fields = {} if model is None else {"model": model}
        assert httpx.post(server.base_url + COMPLETIONS, content=completion(**fields), timeout=60).status_code == 200


def test_unknown_fields_are_ignored(server):
    body = completion(user="someone", metadata={"a": "b"}, service_tier="auto")
    assert httpx.post(server.base_url + COMPLETIONS, content=body, timeout=60).status_code == 200


# Fields that would change the output and are not implemented yet: refused by name, never dropped.
# (id, path, body, the field named in `param`)
UNSUPPORTED = [
    ("functions", CHAT, chat(functions=[{"name": "f"}]), "functions"),
    ("function_call", CHAT, chat(function_call="auto"), "function_call"),
    ("best_of over n", COMPLETIONS, completion(best_of=3), "best_of"),
    ("best_of under n", COMPLETIONS, completion(best_of=1, n=2), "best_of"),
    ("suffix", COMPLETIONS, completion(suffix=" the end"), "suffix"),
    ("use_beam_search", COMPLETIONS, completion(use_beam_search=True), "use_beam_search"),
    ("allowed_token_ids", COMPLETIONS, completion(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    ("bad_words", COMPLETIONS, completion(bad_words=["x"]), "bad_words"),
    ("prompt_logprobs", COMPLETIONS, completion(prompt_logprobs=1), "prompt_logprobs"),
    ("truncate_prompt_tokens", COMPLETIONS, completion(truncate_prompt_tokens=4), "truncate_prompt_tokens"),
    ("chat echo", CHAT, chat(echo=True), "echo"),
    ("no generation prompt", CHAT, chat(add_generation_prompt=False), "add_generation_prompt"),
    ("continue_final_message", CHAT, chat(continue_final_message=True), "continue_final_message"),
    ("chat_template", CHAT, chat(chat_template="{{ messages }}"), "chat_template"),
    ("thinking_token_budget on completions", COMPLETIONS, completion(thinking_token_budget=8),
     "thinking_token_budget"),
    ("audio output", CHAT, chat(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}),
     "modalities"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_fields_that_would_change_the_output_are_refused_by_name(server, path, body, param):
    response = httpx.post(server.base_url + path, content=body, timeout=60)
    error = assert_openai_error(response, 400)
    assert error["code"] == "unsupported_parameter" and error["param"] == param
    assert param.rsplit(".", 1)[-1] in error["message"]


# The same fields at values that change nothing, and fields that only describe the caller, are accepted.
NEUTRAL = [
    ("response_format text", CHAT, chat(response_format={"type": "text"})),
    ("tools empty", CHAT, chat(tools=[], tool_choice="none")),
    ("nulls", CHAT, chat(tools=None, tool_choice=None, response_format=None, functions=None, function_call=None,
                         stream_options=None)),
    ("parallel_tool_calls without tools", CHAT, chat(parallel_tool_calls=True)),
    ("best_of equal to n", COMPLETIONS, completion(best_of=2, n=2)),
    ("suffix empty", COMPLETIONS, completion(suffix="")),
    ("vLLM defaults", CHAT, chat(add_generation_prompt=True, continue_final_message=False, echo=False,
                                 use_beam_search=False, modalities=["text"])),
    ("caller metadata", CHAT, chat(user="u", metadata={"a": "b"}, store=False, service_tier="auto",
                                   prediction=None)),
    ("assistant without content", CHAT, chat(messages=[*USER, {"role": "assistant"}, *USER])),
    ("tool calls in the history", CHAT,
     chat(messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c", "content": "42"}])),
    ("min_tokens equal to max_tokens", COMPLETIONS, completion(max_tokens=2, min_tokens=2, ignore_eos=True)),
    ("stream_options with stream", COMPLETIONS, completion(stream=True, stream_options={"include_usage": True})),
]


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in NEUTRAL], ids=[c[0] for c in NEUTRAL])
def test_fields_at_values_that_change_nothing_are_accepted(server, path, body):
    response = httpx.post(server.base_url + path, content=body, timeout=60)
    assert response.status_code == 200, response.text


def test_no_request_reached_the_catch_all_handler(server):
    """Runs after the corpus above: the server log holds no traceback and no 500."""
    log = server.log()
    assert "Traceback" not in log and "unhandled" not in log and '" 500' not in log
