"""Reasoning models: the thinking split from the answer at every boundary, the budget that ends it, the
template switches, constraints that apply to the answer only — through the tracker, the engine, a real
server and the clients front ends use (openai, LiteLLM, LangChain).

The models are the tiny random ones of tests/thinking_models.py. A random model neither opens nor closes
its thinking by itself: a logit bias on `<think>` makes the Qwen3-shaped one open it (and then write
little else), the budget forces the end, and a bias on `</think>` makes the Qwen3-Thinking-shaped one
end it on its own.
"""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import openai
import pytest

from bench.sse import SSEDecoder
from decoding import load_model
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.engine.reasoning import Phase, ReasoningMarkers, ReasoningParams, ReasoningTracker, initial_phase
from decoding.engine.structured import Constraint
from tests.conftest_server import shared_server
from tests.reliability import running_server
from tests.test_app_resume import read_events
from tests.thinking_models import END_THINK, THINK, deepseek_r1_model, qwen3_thinking_model

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
OPEN = {str(THINK): 100}  # the Qwen3-shaped model opens its thinking with its first token
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}}}  # fmt: skip
TEXT_MARKERS = ReasoningMarkers()
TOKEN_MARKERS = ReasoningMarkers(start_id=THINK, end_id=END_THINK)


# ---- the tracker ------------------------------------------------------------------------------------


def splits(text: str, max_cuts: int = 2):
    """`text` cut in every way at up to `max_cuts` places."""
    for cuts in range(max_cuts + 1):
        for points in itertools.combinations(range(1, len(text)), cuts):
            bounds = (0, *points, len(text))
            yield [text[a:b] for a, b in itertools.pairwise(bounds)]


def feed_all(tracker: ReasoningTracker, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = tracker.feed(0, piece)
        reasoning, content = reasoning + r, content + c
    r, c = tracker.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize(("initial", "text", "reasoning", "content"), [
    (Phase.MAYBE, "\n<think>\nLet me see.\n</think>\n\nFour.", "\nLet me see.\n", "\n\nFour."),
    (Phase.MAYBE, "Four, <think> is text here.", "", "Four, <think> is text here."),
    (Phase.THINKING, "Let me see.</think>Four.", "Let me see.", "Four."),
    (Phase.THINKING, "<think>Let me see.</think>Four.", "Let me see.", "Four."),  # opened twice: once counts
    (Phase.THINKING, "Still </thinking.", "Still </thinking.", ""),  # never closed: all thinking
    (Phase.ANSWERING, "Four.</think>", "", "Four.</think>"),
], ids=["opened-by-the-model", "no-thinking", "opened-by-the-prompt", "opened-again", "unclosed", "answering"])
def test_text_markers_split_the_same_at_every_boundary(initial, text, reasoning, content):
    for pieces in splits(text):
        got = feed_all(ReasoningTracker(ReasoningParams(TEXT_MARKERS, initial)), pieces)
        assert got == (reasoning, content), pieces


def test_marker_tokens_are_matched_by_id_not_by_their_text():
    tracker = ReasoningTracker(ReasoningParams(TOKEN_MARKERS, Phase.MAYBE))
    fed = [(THINK, "<think>"), (5, "a </think> in words"), (END_THINK, "</think>"), (6, " answer")]
    parts = [tracker.feed(token, text) for token, text in fed]
    assert parts == [("", ""), ("a </think> in words", ""), ("", ""), ("", " answer")]
    assert tracker.num_tokens == 3 and tracker.is_answering


def test_the_budget_is_spent_only_between_characters_and_drafts_stay_inside_it():
    tracker = ReasoningTracker(ReasoningParams(TOKEN_MARKERS, Phase.THINKING, budget=3))
    assert tracker.draft_room(answer_constrained=False) == 2
    for _ in range(3):
        tracker.feed(7, "x")
    assert tracker.budget_spent(is_mid_character=False)
    assert not tracker.budget_spent(is_mid_character=True)  # a character the budget cut in half ends first
    for _ in range(4):
        tracker.feed(7, "")
    assert tracker.budget_spent(is_mid_character=True)  # ... but not forever
    assert tracker.draft_room(answer_constrained=False) == 0
    free = ReasoningTracker(ReasoningParams(TOKEN_MARKERS, Phase.THINKING))
    assert free.draft_room(answer_constrained=False) is None
    assert free.cut_drafts([1, END_THINK, 2], answer_constrained=True) == [1]  # the grammar waits for the end
    assert free.cut_drafts([1, END_THINK, 2], answer_constrained=False) == [1, END_THINK, 2]
    text = ReasoningTracker(ReasoningParams(TEXT_MARKERS, Phase.THINKING))
    assert text.draft_room(answer_constrained=True) == 0  # a text end could complete at any token


def test_the_prompt_decides_where_a_choice_starts():
    assert initial_phase("<|im_start|>assistant\n<think>\n", TEXT_MARKERS, False) is Phase.THINKING
    assert initial_phase("assistant\n<think>\n\n</think>\n\n", TEXT_MARKERS, True) is Phase.ANSWERING
    assert initial_phase("</think>done<|im_start|>assistant\n", TEXT_MARKERS, False) is Phase.MAYBE
    assert initial_phase("<|im_start|>assistant\n", TEXT_MARKERS, True) is Phase.THINKING


# ---- the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def opening_model(tmp_path_factory):
    return load_model(qwen3_thinking_model(tmp_path_factory.mktemp("opening"), opens=True))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 11}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("constrained", [False, True], ids=["free", "json"])
def test_speculation_changes_nothing_across_the_end_of_the_thinking(opening_model, constrained, sampling):
    """With n-gram drafts and without, greedy or seeded: the same tokens, the same split, through a
    natural end (a bias on `</think>`), a forced one (the budget) and the answer's grammar."""
    tokenizer = opening_model.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(ASK))
    constraint = Constraint("json", json.dumps(SCHEMA)) if constrained else None
    outputs = {}
    for speculative in ("off", "ngram"):
        engine = Engine(opening_model, EngineConfig(kv_cache_mb=16, kernels="exact", speculative=speculative)).start()
        try:
            runs = []
            for bias, budget in (({END_THINK: 2.5}, None), ({}, 9)):
                params = SamplingParams(max_tokens=120, logit_bias=bias, constraint=constraint, **sampling,
                                        reasoning=ReasoningParams(TOKEN_MARKERS, Phase.THINKING, budget))
                out = engine.generate(prompt, params)[0]
                runs.append((out.token_ids, out.reasoning, out.text, out.usage.reasoning_tokens))
            outputs[speculative] = runs
            if speculative == "ngram":
                assert engine.stats.num_draft_tokens > 0, "no draft ran: the comparison proves nothing"
        finally:
            engine.shutdown()
    assert outputs["ngram"] == outputs["off"]
    natural, forced = outputs["off"]
    if sampling["temperature"] == 0:  # greedy: the bias is known to end the thinking within the 120 tokens
        assert END_THINK in natural[0] and natural[2], "the bias should end the thinking by itself"
    # the budget's 9 tokens, a few more where the 9th cut a character, then the end marker
    ended_at = forced[0].index(END_THINK)
    assert 9 <= ended_at <= 9 + 4 and forced[3] == ended_at + 1
    if constrained:
        assert forced[2], "the answer follows the forced end"
        for _, _, text, _ in outputs["off"]:
            if text:  # a seeded natural run may think to the end of its tokens
                jsonschema.validate(json.loads(text), SCHEMA)


# ---- a real server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    with running_server(["--model", str(qwen3_thinking_model(tmp_path_factory.mktemp("q3"))),
                         "--kv-cache-mb", "32"]) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def qwen3(qwen3_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, **extra):
    model, messages = extra.pop("model", "qwen3-thinking"), extra.pop("messages", ASK)
    return client.chat.completions.create(model=model, messages=messages, **{"seed": 3, "temperature": 1.0, **extra})


def test_the_thinking_comes_apart_from_the_answer_under_both_names(qwen3):
    """Token by token: `<think>` opens, three tokens of thinking (each `<think>` again, as text), the budget
    forces `</think>` after four, and the answer follows."""
    response = ask(qwen3, max_tokens=10, extra_body={"logit_bias": OPEN, "thinking_token_budget": 4})
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "<think>" * 3
    assert message.content == "<think>" * 5  # past the thinking, the bias writes it as text
    assert response.usage.completion_tokens_details.reasoning_tokens == 5


def test_a_stream_sends_the_thinking_first_and_adds_up_to_the_whole_answer(qwen3):
    extra = {"max_tokens": 24, "extra_body": {"logit_bias": OPEN, "thinking_token_budget": 7}}
    whole = ask(qwen3, **extra).choices[0].message
    kinds, reasoning, content = [], "", ""
    for chunk in ask(qwen3, stream=True, stream_options={"include_usage": True}, **extra):
        if not chunk.choices:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == 8
            continue
        delta = chunk.choices[0].delta
        extra_fields = delta.model_extra or {}
        if extra_fields.get("reasoning_content"):
            assert extra_fields["reasoning"] == extra_fields["reasoning_content"]
            reasoning += extra_fields["reasoning_content"]
            kinds.append("reasoning")
        if delta.content:
            content += delta.content
            kinds.append("content")
    assert kinds == sorted(kinds, reverse=True), "every reasoning delta comes before the content"
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)


def test_enable_thinking_false_closes_the_thinking_in_the_prompt(qwen3):
    response = ask(qwen3, max_tokens=6, extra_body={"logit_bias": OPEN,
                                                    "chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert message.content == "<think>" * 6 and message.model_extra["reasoning_content"] is None
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_none_reaches_the_template_as_enable_thinking_false(qwen3):
    message = ask(qwen3, max_tokens=4, reasoning_effort="none", extra_body={"logit_bias": OPEN}).choices[0].message
    assert message.content == "<think>" * 4


def test_json_after_thinking_holds_to_its_schema(qwen3):
    for seed in range(3):
        response = ask(qwen3, seed=seed, max_tokens=80, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
            extra_body={"logit_bias": OPEN, "thinking_token_budget": 5})  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "stop" and response.usage.completion_tokens_details.reasoning_tokens == 6
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_forced_tool_call_after_thinking_is_a_valid_call(qwen3):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}}}}}  # fmt: skip
    response = ask(qwen3, max_tokens=80, tools=[weather], tool_choice="required",
                   extra_body={"logit_bias": OPEN, "thinking_token_budget": 3})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == "<think>" * 2
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def test_completions_are_raw_text(qwen3):
    text = qwen3.completions.create(model="qwen3-thinking", prompt="<|im_start|>assistant\n", max_tokens=3,
                                    logit_bias=OPEN, seed=1).choices[0].text
    assert text == "<think>" * 3


def test_reasoning_in_the_history_reaches_the_template_as_it_expects(qwen3_server):
    """Qwen3's template keeps the thinking of a turn after the last question and drops older ones."""
    def tokens(messages):
        response = httpx.post(qwen3_server.base_url + "/tokenize", json={"messages": messages}, timeout=30)
        return httpx.post(qwen3_server.base_url + "/detokenize", json={"tokens": response.json()["tokens"]},
                          timeout=30).json()["prompt"]  # fmt: skip

    turn = {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
    assert "<think>\nTwo and two.\n</think>" in tokens([*ASK, turn])
    assert "Two and two." in tokens([*ASK, {**turn, "reasoning_content": None, "reasoning": "Two and two."}])
    assert "Two and two." not in tokens([*ASK, turn, {"role": "user", "content": "And 3 + 3?"}])


@pytest.fixture(scope="module")
def opening_server(tmp_path_factory):
    with running_server(["--model", str(qwen3_thinking_model(tmp_path_factory.mktemp("q3t"), opens=True)),
                         "--kv-cache-mb", "32", "--default-thinking-budget", "8"]) as server:  # fmt: skip
        yield server


def test_the_responses_api_streams_a_reasoning_item_before_the_message(opening_server):
    client = openai.OpenAI(base_url=f"{opening_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"model": "qwen3-thinking-2507", "input": "What is 2 + 2?", "max_output_tokens": 30, "temperature": 1.0,
            "extra_body": {"seed": 2}}  # fmt: skip
    events = list(client.responses.create(stream=True, **body))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == streamed
    assert message.type == "message" and final.usage.output_tokens_details.reasoning_tokens > 0
    stored = client.responses.retrieve(final.id)
    assert stored.output[0].content[0].text == streamed
    follow_up = client.responses.create(**{**body, "input": "And 3 + 3?"}, previous_response_id=final.id)
    assert follow_up.status in ("completed", "incomplete")
    closed = client.responses.create(**body, reasoning={"effort": "none"})  # the template closes the thinking
    assert [item.type for item in closed.output] == ["message"]
    assert closed.usage.output_tokens_details.reasoning_tokens == 0


def test_a_stream_cut_mid_thinking_resumes_with_the_same_split(opening_server):
    # the server's budget of 8 ends the thinking, and with ignore_eos no EOS ends the answer before it starts
    body = {"messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 5, "stream": True, "ignore_eos": True}
    url = opening_server.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        uncut = read_events(response.iter_raw(), SSEDecoder())

    def thinking(data: str) -> bool:
        return data != "[DONE]" and "reasoning_content" in json.loads(data)["choices"][0]["delta"]

    client = httpx.Client(timeout=120)
    with client.stream("POST", url, json=body) as response:
        # cut at the first thinking event: a count of events would not do, as a busy machine sends several
        # tokens in one event and the third may already be the answer
        before = read_events(response.iter_raw(), SSEDecoder(), stop_at=thinking)
    client.close()
    stream_id = json.loads(before[0][1])["id"]
    with httpx.stream("GET", f"{url}/{stream_id}/stream", headers={"Last-Event-ID": str(before[-1][0])},
                      timeout=120) as response:
        after = read_events(response.iter_raw(), SSEDecoder())

    def split(events):
        deltas = [json.loads(data)["choices"][0]["delta"] for _, data in events if data != "[DONE]"]
        return tuple("".join(d.get(key) or "" for d in deltas) for key in ("reasoning_content", "content"))

    cut_at = json.loads(before[-1][1])["choices"][0]["delta"]
    assert "reasoning_content" in cut_at and cut_at.get("content") is None, "cut inside the thinking"
    assert split(before + after) == split(uncut) and all(split(uncut))


def test_the_clients_front_ends_use_read_the_answer_and_the_thinking_apart(opening_server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network at import
    import litellm
    from langchain_openai import ChatOpenAI

    base = f"{opening_server.base_url}/v1"
    extra = {"seed": 5, "ignore_eos": True}  # the budget ends the thinking, and an answer always follows
    reference = httpx.post(base + "/chat/completions", json={"messages": ASK, "max_tokens": 40, "temperature": 1.0,
                                                             **extra}, timeout=120).json()["choices"][0]["message"]
    assert reference["reasoning_content"] and reference["content"]
    lite = litellm.completion(model="openai/qwen3-thinking-2507", api_base=base, api_key="unused", messages=ASK,
                              max_tokens=40, temperature=1.0, extra_body=extra)  # fmt: skip
    assert lite.choices[0].message.reasoning_content == reference["reasoning_content"]
    assert lite.choices[0].message.content == reference["content"]
    chat = ChatOpenAI(base_url=base, api_key="unused", model="qwen3-thinking-2507", max_tokens=40, temperature=1.0,
                      extra_body=extra)  # fmt: skip
    answer = chat.invoke([("user", ASK[0]["content"])])
    assert answer.content == reference["content"]  # the answer only: the thinking is not in it


@pytest.mark.parametrize(("fields", "param"), [
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"prompt": "Hi", "thinking_token_budget": 5}, "thinking_token_budget"),  # completions are raw text
    ({"prompt": "Hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
])
def test_reasoning_fields_that_cannot_be_honoured_are_400s(qwen3_server, fields, param):
    path, body = ("/v1/completions", {}) if "prompt" in fields else ("/v1/chat/completions", {"messages": ASK})
    response = httpx.post(qwen3_server.base_url + path, json={**body, "max_tokens": 2, **fields}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_model_that_does_not_think_refuses_a_thinking_budget():
    base = shared_server("main").base_url
    response = httpx.post(base + "/v1/chat/completions",
                          json={"messages": ASK, "max_tokens": 2, "thinking_token_budget": 5}, timeout=30)
    assert response.status_code == 400 and "reasoning parser" in response.json()["error"]["message"]
    response = httpx.post(base + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                                         "reasoning": {"effort": "low"}}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning.effort", response.text


# ---- DeepSeek-R1's shape: the prompt opens the thinking, the markers are text ---------------------------


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory):
    with running_server(["--model", str(deepseek_r1_model(tmp_path_factory.mktemp("r1"))), "--kv-cache-mb", "32",
                         "--log-level", "info"]) as server:  # fmt: skip
        yield server


def test_text_markers_split_and_a_spent_budget_writes_the_end_as_text(r1_server):
    assert "reasoning parser: deepseek_r1 (chosen by auto" in r1_server.log()
    client = openai.OpenAI(base_url=f"{r1_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in range(3):
        response = ask(client, model="r1-distill", seed=seed, max_tokens=40, extra_body={"thinking_token_budget": 6})
        message = response.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert "think>" not in reasoning + (message.content or "")
        assert response.usage.completion_tokens_details.reasoning_tokens > 6  # and the end marker's tokens
        json_answer = ask(client, model="r1-distill", seed=seed, max_tokens=80, response_format={"type": "json_object"},
                          extra_body={"thinking_token_budget": 4}).choices[0].message
        assert isinstance(json.loads(json_answer.content), dict) and json_answer.model_extra["reasoning_content"]


def client_prompt(server) -> str:
    ids = httpx.post(server.base_url + "/tokenize", json={"messages": ASK}, timeout=30).json()["tokens"]
    return httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]


def test_a_chat_template_file_replaces_the_models_and_a_broken_one_stops_the_start(tmp_path):
    directory = deepseek_r1_model(tmp_path)
    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    bad.write_text("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}")
    with running_server(["--model", str(directory), "--kv-cache-mb", "16", "--chat-template", str(good),
                         "--reasoning-parser", "none"]) as server:  # fmt: skip
        assert client_prompt(server) == "[user] What is 2 + 2?\n[assistant]"
    import subprocess
    import sys

    failed = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--model", str(directory), "--chat-template",
                             str(bad)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert failed.returncode == 2 and "--chat-template" in failed.stderr and "bad.jinja" in failed.stderr


def test_each_choice_thinks_apart_and_calls_written_inside_the_thinking_are_not_calls(opening_server):
    """n = 2: each choice has its own split (choice 0 as a request of its own with the seed); under
    tool_choice auto a `<tool_call>` token inside the thinking is thinking, one after it a call."""
    url = opening_server.base_url + "/v1/chat/completions"
    base = {"messages": ASK, "max_tokens": 30, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    single = httpx.post(url, json=base, timeout=120).json()["choices"][0]["message"]
    pair = httpx.post(url, json={**base, "n": 2, "logprobs": True}, timeout=120).json()
    first = pair["choices"][0]
    assert (first["message"]["reasoning_content"], first["message"]["content"]) == (
        single["reasoning_content"], single["content"])
    assert all(c["message"]["reasoning_content"] and c["logprobs"]["content"] for c in pair["choices"])
    tool = {"type": "function", "function": {"name": "roll_die", "parameters": {"type": "object", "properties": {}}}}
    calling = {**base, "tools": [tool], "tool_choice": "auto", "thinking_token_budget": 4, "max_tokens": 60,
               "logit_bias": {"378": 100}}  # `<tool_call>` at every chance: inside the thinking and after it
    choice = httpx.post(url, json=calling, timeout=120).json()["choices"][0]
    assert choice["message"]["reasoning_content"].startswith("<tool_call>")
    calls = choice["message"]["tool_calls"]  # the bias opens call after call until max_tokens
    assert calls and all(c["function"] == {"name": "roll_die", "arguments": "{}"} for c in calls)
