"""The official `openai` client against a real `treadle serve`: chat and completions, streamed and not,
greedy text equal to transformers' (tests/golden), and the sampling parameters that change output."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from decoding import DEFAULT_MODEL as MODEL

from .conftest import GOLDEN
from .conftest_server import TreadleServer, shared_server
from .reliability import running_server, write_tiny_gguf
from .tinymodel import CHAT_TEMPLATE as TINY_CHAT_TEMPLATE

pytestmark = pytest.mark.slow

CHAT_QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")


@pytest.fixture(scope="module")
def client(server: TreadleServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def golden_greedy(name: str, default_model, max_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy continuation up to EOS)."""
    golden = np.load(GOLDEN / f"logits_{name}.npz")
    greedy = golden["greedy_ids"].tolist()
    eos = default_model.config.eos_token_ids
    end = next((i for i, t in enumerate(greedy) if t in eos), len(greedy))
    return golden["ids"].tolist(), greedy[: min(end, max_tokens or end)]


def test_chat_greedy_reply_equals_transformers(client, server, default_model):
    prompt_ids, reply_ids = golden_greedy("chat", default_model)
    rendered = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT_QUESTION}).json()
    assert rendered["tokens"] == prompt_ids and rendered["count"] == len(prompt_ids)

    response = client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == default_model.tokenizer.decode(reply_ids)
    assert choice.finish_reason == "stop"
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(reply_ids) + 1  # the EOS token counts, as in vLLM


def test_chat_stream_has_openais_chunk_sequence_and_the_same_text(client, default_model):
    _, reply_ids = golden_greedy("chat", default_model)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].delta.content is None and chunks[-1].choices[0].delta.role is None
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)  # no usage chunk unless asked
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == default_model.tokenizer.decode(reply_ids)


def test_include_usage_adds_one_usage_chunk_with_no_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4
    assert all(c.usage is None and c.choices for c in chunks[:-1])


def test_completion_greedy_text_equals_transformers_streamed_and_not(client, default_model):
    prompt_ids, expected_ids = golden_greedy("capital", default_model, max_tokens=10)
    expected = default_model.tokenizer.decode(expected_ids)
    prompt = default_model.tokenizer.decode(prompt_ids)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_prompt_may_be_token_ids(client, default_model):
    prompt_ids, expected_ids = golden_greedy("digits", default_model, max_tokens=8)
    response = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0)
    assert response.choices[0].text == default_model.tokenizer.decode(expected_ids)


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_indexed_choices(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         seed=1234, n=2)

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 16


def test_stop_string_ends_the_reply_before_it(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, temperature=0, stop=[" Paris"])
    assert response.choices[0].message.content == "The capital of France is"
    assert response.choices[0].finish_reason == "stop"


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, max_tokens=9,
                                              max_completion_tokens=3)
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_completions_honour_max_completion_tokens_too(client):
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9,
                                         extra_body={"max_completion_tokens": 3})
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token(client, default_model):
    paris = default_model.tokenizer.encode(" Paris")
    assert len(paris) == 1
    response = client.completions.create(model=MODEL, prompt="I like", max_tokens=2, temperature=0,
                                         logit_bias={str(paris[0]): 100})
    assert response.choices[0].text == " Paris Paris"


def test_chat_logprobs_list_each_token_with_its_alternatives(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, temperature=0, max_tokens=5,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5) and entry.logprob <= 0
        assert bytes(entry.bytes).decode() == entry.token


def test_completion_echo_with_logprobs_scores_the_prompt_too(client, default_model):
    prompt = "The capital of France is"
    num_prompt_tokens = len(default_model.tokenizer.encode(prompt))
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt_tokens + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts token 0
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_models_lists_the_served_model(client, default_model):
    assert [m.id for m in client.models.list().data] == [default_model.name]


def test_tokenize_and_detokenize_round_trip(server, default_model):
    text = "Hello, wörld! 你好"
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == default_model.tokenizer.encode(text, add_special_tokens=True)
    assert tokens["max_model_len"] == default_model.config.max_context
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}


def test_streamed_choices_each_get_a_role_chunk_and_a_finish_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, max_tokens=3, n=2, seed=7,
                                                 stream=True))
    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        by_index[chunk.choices[0].index].append(chunk.choices[0])
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices].count("length") == 1 and choices[-1].finish_reason == "length"


def test_min_tokens_holds_off_eos_and_stop_token_ids(client, default_model):
    """vLLM's meaning: EOS and the stop token ids cannot be sampled before min_tokens tokens (their logits
    are masked), so a reply pushed to end at once still has min_tokens tokens first."""
    eos = default_model.config.eos_token_ids[0]
    paris = default_model.tokenizer.encode(" Paris")[0]
    to_eos = {"model": MODEL, "prompt": "I like", "max_tokens": 10, "temperature": 0, "logit_bias": {str(eos): 100}}
    assert client.completions.create(**to_eos).usage.completion_tokens == 1  # the EOS token at once
    response = client.completions.create(**to_eos, extra_body={"min_tokens": 4})
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "stop"
    assert len(default_model.tokenizer.encode(response.choices[0].text)) == 4
    to_paris = {"model": MODEL, "prompt": "I like", "max_tokens": 10, "temperature": 0,
                "logit_bias": {str(paris): 100}}
    response = client.completions.create(**to_paris, extra_body={"stop_token_ids": [paris], "min_tokens": 3})
    choice = response.choices[0]
    assert response.usage.completion_tokens == 4 and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == paris and "Paris" not in choice.text


def test_min_tokens_lets_a_stop_string_end_the_text_only_after_min_tokens(client, default_model):
    paris = default_model.tokenizer.encode(" Paris")[0]
    forced = {"model": MODEL, "prompt": "I like", "max_tokens": 8, "temperature": 0, "stop": [" Paris"],
              "logit_bias": {str(paris): 100}}
    assert client.completions.create(**forced).choices[0].text == ""
    for stream in (False, True):
        response = client.completions.create(**forced, stream=stream, extra_body={"min_tokens": 3})
        choices = [c.choices[0] for c in response] if stream else response.choices
        assert "".join(c.text for c in choices) == " Paris Paris Paris"
        assert choices[-1].finish_reason == "stop" and choices[-1].model_extra["stop_reason"] == " Paris"


def test_include_stop_str_in_output_keeps_the_matched_stop_string(client):
    asked = {"model": MODEL, "messages": CHAT_QUESTION, "temperature": 0, "stop": ["nothing here", " Paris"],
             "extra_body": {"include_stop_str_in_output": True}}
    response = client.chat.completions.create(**asked)
    assert response.choices[0].message.content == "The capital of France is Paris"
    assert response.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**asked, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of France is Paris"


@pytest.mark.parametrize("temperature", [1e-6, 1e-9, 1e-40, 1e-310])
def test_a_temperature_below_1e_5_is_greedy(client, temperature):
    def text(t: float) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=t,
                                         seed=3).choices[0].text

    assert text(temperature) == text(0)


def test_every_chat_and_completion_object_carries_one_system_fingerprint(client):
    objects = [client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, max_tokens=2),
               *client.chat.completions.create(model=MODEL, messages=CHAT_QUESTION, max_tokens=2, stream=True,
                                               stream_options={"include_usage": True}),
               client.completions.create(model=MODEL, prompt="I like", max_tokens=2),
               *client.completions.create(model=MODEL, prompt="I like", max_tokens=2, stream=True)]
    fingerprints = {o.system_fingerprint for o in objects}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_treadle_")


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random model served under the names front ends are configured with (vLLM's option)."""
    model = write_tiny_gguf(tmp_path_factory.mktemp("named") / "tiny.gguf", TINY_CHAT_TEMPLATE)
    with running_server(["--model", str(model), "--served-model-name", "gpt-4o-mini", "team/llm"]) as named:
        yield named


def test_served_model_names_are_accepted_and_listed_and_the_first_is_reported(named_server):
    client = openai.OpenAI(base_url=f"{named_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["gpt-4o-mini", "team/llm"]
    for name in ("gpt-4o-mini", "team/llm"):
        chat = client.chat.completions.create(model=name, messages=CHAT_QUESTION, max_tokens=2)
        chunks = list(client.completions.create(model=name, prompt="I like", max_tokens=2, stream=True))
        assert {chat.model, *(c.model for c in chunks)} == {"gpt-4o-mini"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="I like", max_tokens=2)  # the file's own name is not one
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="I like", max_tokens=2)
    assert httpx.post(f"{named_server.base_url}/v1/completions", json={"prompt": "I like", "max_tokens": 2},
                      timeout=60).status_code == 200  # no model named: the served one
