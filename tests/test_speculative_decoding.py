"""Speculative decoding changes nothing a request generates: the same tokens, text, logprobs and finish
reasons as plain decoding — greedy and seeded, whatever the batch, the chunk size, the draft length or
preemption — and drafts never run past max_tokens or the context."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.engine.structured import Constraint

CODE = '''def total(items):
    result = 0
    for item in items:
        result += item.price * item.quantity
    return result
'''
PROMPTS = [
    "Copy this code exactly.\n" + CODE + "\nThe copy:\n" + CODE[:40],
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
    "The weaver said: the loom is old, the loom is slow, the loom is mine. The weaver said: the loom",
    "Write a short poem about the sea.",
]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0),
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7),
    SamplingParams(max_tokens=40, temperature=1.0, seed=3, repetition_penalty=1.1, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["quantity"], logprobs=0),
    SamplingParams(max_tokens=3, temperature=0.0),
    SamplingParams(max_tokens=30, temperature=0.9, seed=11, n=2),
    SamplingParams(max_tokens=30, temperature=0.7, seed=5, min_tokens=20, frequency_penalty=0.5),
]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[tuple]]:
    """Every request submitted at once; each choice as (tokens, text, finish reason, logprobs)."""
    streams = [engine.submit(ids, params) for ids, params in requests]
    results: list[list[tuple]] = [[] for _ in streams]

    def drain(i: int) -> None:
        merged: dict[int, object] = {}
        for output in streams[i]:
            if output.index in merged:
                merged[output.index].merge(output)
            else:
                merged[output.index] = output
        results[i] = [(o.token_ids, o.text, o.finish_reason,
                       [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs])
                      for o in (merged[k] for k in sorted(merged))]  # fmt: skip

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.num_kv_blocks_used == 0
    return results


@pytest.fixture(scope="module")
def engines(default_model):
    started: dict[str, Engine] = {}

    def get(name: str, **config) -> Engine:
        if name not in started:
            started[name] = Engine(default_model, EngineConfig(kv_cache_mb=64, **config)).start()
        return started[name]

    yield get
    for engine in started.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    return [default_model.tokenizer.encode(p) for p in PROMPTS]


def test_drafts_are_accepted_and_change_nothing(engines, prompt_ids):
    requests = [(ids, params) for ids in prompt_ids for params in PARAMS[:4]]
    plain = run(engines("off", speculative="off"), requests)
    speculative = engines("ngram", speculative="ngram")
    before = speculative.stats.num_accepted_draft_tokens
    assert run(speculative, requests) == plain
    assert speculative.stats.num_accepted_draft_tokens - before > 50  # the repeating prompts were drafted


def test_preempted_speculating_sequences_still_match(engines, prompt_ids):
    """A cache of 24 blocks of 16 tokens for eight 100-token answers: sequences are preempted and
    recomputed while they speculate."""
    requests = [(prompt_ids[i % 3], SamplingParams(max_tokens=100, temperature=0.8, seed=i, ignore_eos=True))
                for i in range(8)]  # fmt: skip
    plain = run(engines("off", speculative="off"), requests)
    tight = engines("tight", speculative="ngram", num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)
    assert run(tight, requests) == plain
    assert tight.scheduler.num_preemptions > 0 and tight.stats.num_accepted_draft_tokens > 0


def test_drafts_never_pass_max_tokens_or_the_context(default_model, prompt_ids):
    ids = prompt_ids[1]  # the counting prompt: every draft would be accepted
    engine = Engine(default_model, EngineConfig(kv_cache_mb=64, speculative="ngram",
                                                max_model_len=len(ids) + 6)).start()  # fmt: skip
    try:
        for max_tokens in (1, 2, 5):
            (out,) = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        (out,) = engine.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 6 and out.finish_reason == "length"  # the last position of the context
        assert engine.stats.num_accepted_draft_tokens > 0 and engine.num_kv_blocks_used == 0
    finally:
        engine.shutdown()


def test_structured_output_is_verified_against_its_grammar(engines, default_model):
    schema = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
        "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False}  # fmt: skip
    ids = default_model.tokenizer.encode('A shopping list as JSON: {"items": [{"name": "apple", "qty": 1}, '
                                         '{"name": "pear", "qty": 2}, {"name": "plum", "qty": 3}]}\nAnother one: ')
    constraint = Constraint("json", json.dumps(schema))
    requests = [(ids, SamplingParams(max_tokens=150, temperature=t, seed=s, constraint=constraint))
                for t, s in ((0.0, None), (0.7, 1), (1.0, 2))]  # fmt: skip
    plain = run(engines("off", speculative="off"), requests)
    speculative = engines("ngram", speculative="ngram")
    before = speculative.stats.num_accepted_draft_tokens
    assert run(speculative, requests) == plain
    assert speculative.stats.num_accepted_draft_tokens > before
    for (choice,) in plain:
        if choice[2] == "stop":
            jsonschema.validate(json.loads(choice[1]), schema)


CONFIGS = {
    "small-chunks": {"max_num_batched_tokens": 16, "max_num_seqs": 16, "speculative_max_tokens": 8},
    "short-drafts": {"max_num_batched_tokens": 64, "speculative_max_tokens": 2},
    "auto": {"speculative": "auto"},
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choices=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, len(PARAMS) - 1)),
                        min_size=1, max_size=6),
       config=st.sampled_from(sorted(CONFIGS)))  # fmt: skip
def test_any_mix_of_requests_batches_and_chunks_matches_plain_decoding(engines, prompt_ids, choices, config):
    requests = [(prompt_ids[p], PARAMS[k]) for p, k in choices]
    plain = run(engines("off", speculative="off"), requests)
    options = {"speculative": "ngram", **CONFIGS[config]}
    assert run(engines(config, **options), requests) == plain


def test_usage_and_metrics_report_the_drafts_over_http():
    import openai

    from tests.reliability import running_server

    with running_server(["--speculative", "ngram", "--speculative-max-tokens", "6", "--kv-cache-mb", "64"]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=30, temperature=0)
        drafts = completion.usage.model_extra["speculative"]
        assert 0 < drafts["accepted"] <= drafts["drafted"]
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=30, temperature=0, stream=True,
                                                stream_options={"include_usage": True})  # fmt: skip
        usage = [chunk.usage for chunk in stream if chunk.usage][-1]
        streamed = usage.model_extra.get("speculative", {"drafted": 0, "accepted": 0})
        samples = server.wait_for_metrics(lambda m: m.get("treadle_spec_draft_tokens_total", 0)
                                          >= drafts["drafted"] + streamed["drafted"])  # fmt: skip
        assert samples["treadle_spec_draft_tokens_total"] == drafts["drafted"] + streamed["drafted"]
        assert samples["treadle_spec_accepted_tokens_total"] == drafts["accepted"] + streamed["accepted"]
    with running_server(["--speculative", "off", "--kv-cache-mb", "64"]) as server:
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0})  # fmt: skip
        assert "speculative" not in reply.json()["usage"]  # only where speculation ran
