"""Fuzzed input against a real `treadle serve` (a tiny random model, so valid requests cost little):
schemathesis from the app's own /openapi.json, then a hypothesis corpus of malformed bodies. Every answer
is a 4xx or a 200 — never a 5xx — the server stays up and its memory stays bounded. The number of
cases tried is printed (`pytest -s`) and checked against a floor."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import httpx
import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from .conftest_server import TreadleServer
from .reliability import running_server, write_tiny_gguf
from .tinymodel import CHAT_TEMPLATE, TinyShape, tiny_vocab

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
SCHEMATHESIS_EXAMPLES = 40  # per operation and mode (positive: fits the schema; negative: does not)
CORPUS_EXAMPLES = 250
# The megabyte bodies raise the high-water mark by ~150-200 MiB (allocator arenas of the worker threads);
# repeated rounds of this corpus then plateau (measured 1025, 1020, 1041, 1024 MiB), where a leak would climb.
MAX_RSS_GROWTH_MIB = 384
SETTINGS: dict[str, Any] = {"deadline": None, "database": None, "phases": [Phase.generate],
                            "suppress_health_check": list(HealthCheck)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", CHAT_TEMPLATE)
    with running_server(["--model", str(model), "--max-queue", "64"]) as tiny:
        yield tiny


def rss_mib(server: TreadleServer) -> float:
    return server.metrics()["process_resident_memory_bytes"] / (1 << 20)


def assert_healthy(server: TreadleServer) -> None:
    assert server.process.poll() is None, server.log()
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    server.wait_for_metrics(lambda m: m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0)


def test_schemathesis_cases_from_the_openapi_schema_never_get_a_5xx(server):
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()["paths"]
    statuses: Counter[tuple[str, str, int]] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        takes_a_body = "requestBody" in paths[operation.path][operation.method.lower()]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and not takes_a_body:
                continue  # no body and no declared parameters: nothing can be outside the schema
            fuzz_operation(server, operation, mode, statuses, failures)
    print(f"\nschemathesis: {sum(statuses.values())} cases")
    for (label, mode_name, status), count in sorted(statuses.items()):
        print(f"  {label:<28} {mode_name:<8} {status}: {count}")
    assert not failures, failures[:5]
    assert sum(statuses.values()) >= 8 * SCHEMATHESIS_EXAMPLES  # four POST routes, two modes
    assert_healthy(server)


def fuzz_operation(server: TreadleServer, operation: Any, mode: GenerationMode,
                   statuses: Counter[tuple[str, str, int]], failures: list[str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=SCHEMATHESIS_EXAMPLES, **SETTINGS)
    def call(case: Any) -> None:
        response = case.call(base_url=server.base_url, timeout=120)
        statuses[operation.label, mode.value, response.status_code] += 1
        # a queue `timeout` shorter than the wait is the client's own deadline: 503 queue_timeout, as documented
        asked_for_it = isinstance(case.body, dict) and case.body.get("timeout") is not None and \
            response.status_code == 503 and response.json()["error"]["code"] == "queue_timeout"
        if response.status_code >= 500 and not asked_for_it:
            failures.append(f"{response.status_code} {operation.label}: {case.body!r:.300} → {response.text:.300}")
        if mode == GenerationMode.NEGATIVE and response.status_code == 200:
            failures.append(f"200 for a body outside the schema: {operation.label} {case.body!r:.300}")

    call()


@pytest.mark.parametrize("ids", [[2**32], [2**63], [-1], [5, 2**40]])
def test_echoed_token_ids_past_the_vocabulary_get_400_not_500(server, ids):
    """Found by schemathesis: `echo` decoded the ids before anything checked them, and the tokenizer
    overflows past 32 bits."""
    response = httpx.post(f"{server.base_url}{COMPLETIONS}", json={"prompt": ids, "echo": True, "max_tokens": 1},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


# ---- a corpus of malformed bodies -------------------------------------------------------------------

VALID = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         COMPLETIONS: {"prompt": "hi", "max_tokens": 2}, TOKENIZE: {"prompt": "hi"}, DETOKENIZE: {"tokens": [1, 2]}}
NUMERIC_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed", "top_k", "min_p",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs")
FIELDS = (*NUMERIC_FIELDS, "messages", "prompt", "stop", "stream", "stream_options", "logit_bias", "stop_token_ids",
          "model", "tokens", "echo", "ignore_eos", "n")
VOCAB_SIZE = len(tiny_vocab()[0])
CONTEXT = TinyShape().max_context
# Not JSON (the first three), or past a float's range (read as infinities): no field may hold them.
NOT_JSON_NUMBERS = ("NaN", "Infinity", "-Infinity")
NOT_NUMBERS = (*NOT_JSON_NUMBERS, "1e999", "-1e999")
routes = st.sampled_from(list(VALID))
any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                        | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


msgpack_value = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
                             | st.text(max_size=20) | st.binary(max_size=20),
                             lambda inner: st.lists(inner, max_size=4)
                             | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def body(path: str, **fields: Any) -> bytes:
    return json.dumps({**VALID[path], **fields}).encode()


@st.composite
def malformed(draw: st.DrawFn) -> tuple[str, str, bytes, bool]:
    """(path, content type, body, must the answer be 4xx); only a non-5xx is demanded of the rest."""
    path = draw(routes)
    kind = draw(st.sampled_from(["bytes", "truncated", "utf8", "number", "type", "type", "type", "nesting",
                                 "messages", "stop", "ids", "bias", "msgpack", "msgpack", "megabyte"]))
    if kind == "bytes":  # garbage: never a valid request
        return path, "application/json", draw(st.binary(max_size=300)), True
    if kind == "truncated":
        raw = body(path)
        return path, "application/json", raw[: draw(st.integers(0, len(raw) - 1))], True
    if kind == "utf8":  # raw bytes that are not UTF-8 inside a string
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]))
        return path, "application/json", b'{"prompt": "a' + bad + b'b", "messages": "' + bad + b'"}', True
    if kind == "number":
        field, token = draw(st.sampled_from(NUMERIC_FIELDS)), draw(st.sampled_from(NOT_NUMBERS))
        # an infinity in a field the route does not have is ignored, as unknown fields are
        return path, "application/json", body(path)[:-1] + f', "{field}": {token}}}'.encode(), token in NOT_JSON_NUMBERS
    if kind == "type":  # any JSON in any field: huge, negative, wrong type, null — valid or not
        value = draw(any_json | st.integers(-(2**200), 2**200) | st.floats(allow_nan=False, allow_infinity=False))
        return path, "application/json", body(path, **{draw(st.sampled_from(FIELDS)): value}), False
    if kind == "nesting":  # in the route's own input field, where no nesting is valid
        depth = draw(st.sampled_from([100, 1_000, 10_000, 100_000, 500_000]))
        field = {CHAT: "messages", DETOKENIZE: "tokens"}.get(path, "prompt")
        nested = b"[" * depth + b"]" * depth
        return path, "application/json", body(path)[:-1] + b', "' + field.encode() + b'": ' + nested + b"}", True
    if kind == "messages":  # thousands of messages: the prompt cannot fit the tiny model's context
        count = draw(st.integers(1_000, 5_000))
        messages = [{"role": "user", "content": "hello there"}] * count
        path = draw(st.sampled_from([CHAT, TOKENIZE]))
        return path, "application/json", body(path, messages=messages, prompt=None), path == CHAT
    if kind == "stop":  # thousands of stop strings
        stops = draw(st.lists(st.text(min_size=1, max_size=3), min_size=1_000, max_size=3_000))
        return CHAT, "application/json", body(CHAT, stop=stops), True
    if kind == "ids":  # long lists of token ids, some past the vocabulary or negative
        ids = draw(st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=5_000))
        path = draw(st.sampled_from([COMPLETIONS, DETOKENIZE]))
        must_fail = any(not 0 <= i < VOCAB_SIZE for i in ids) or path == COMPLETIONS and len(ids) + 2 > CONTEXT
        return path, "application/json", body(path, prompt=ids, tokens=ids), must_fail
    if kind == "bias":
        bias = draw(st.dictionaries(st.text(max_size=30), st.floats(allow_nan=False, allow_infinity=False),
                                    max_size=2000))
        return COMPLETIONS, "application/json", body(COMPLETIONS, logit_bias=bias), False
    if kind == "msgpack":  # msgpack carries what JSON cannot: NaN, bytes, huge unsigned ints
        value = draw(msgpack_value)
        field = draw(st.sampled_from(FIELDS))
        raw = msgpack.packb({**VALID[path], field: value}) if draw(st.booleans()) else draw(st.binary(max_size=100))
        return path, "application/msgpack", raw, False
    # megabyte strings: 1 to 5 MB, past the 4 MiB body limit (413) or past the context (400)
    size = draw(st.sampled_from([1, 3, 5])) << 20
    return path, "application/json", body(path, prompt="ab " * (size // 3), messages=[
        {"role": "user", "content": "ab " * (size // 3)}]), path in (CHAT, COMPLETIONS)


def test_a_corpus_of_malformed_bodies_gets_4xx_never_5xx_and_memory_stays_bounded(server):
    rss_before = rss_mib(server)
    statuses: Counter[int] = Counter()
    failures: list[str] = []

    @given(case=malformed())
    @settings(max_examples=CORPUS_EXAMPLES, **SETTINGS)
    def send(case: tuple[str, str, bytes, bool]) -> None:
        path, content_type, raw, must_be_4xx = case
        response = httpx.post(f"{server.base_url}{path}", content=raw, headers={"Content-Type": content_type},
                              timeout=120)
        statuses[response.status_code] += 1
        is_4xx = 400 <= response.status_code < 500
        if response.status_code >= 500 or (must_be_4xx and not is_4xx):
            failures.append(f"{response.status_code} for {path} {raw[:200]!r}: {response.text[:200]}")
        if is_4xx and content_type == "application/json":
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    send()
    rss_after = rss_mib(server)
    print(f"\nmalformed corpus: {sum(statuses.values())} cases, statuses {dict(sorted(statuses.items()))}, "
          f"RSS {rss_before:.0f} → {rss_after:.0f} MiB")
    assert not failures, failures[:5]
    assert sum(statuses.values()) >= CORPUS_EXAMPLES * 0.9  # hypothesis may stop a little short; not far
    assert math.isfinite(rss_after) and rss_after - rss_before < MAX_RSS_GROWTH_MIB
    assert_healthy(server)
