"""KV cache exhaustion through the server: with a cache far too small for the requests running together,
preemption keeps every request alive, all complete, and their outputs equal those of the same requests
run one at a time on the same server; a request that could never fit is refused with 400 at once."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.soak_checks import check_sse_events

from .conftest_server import TreadleServer
from .reliability import StreamReader, running_server

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
# 6 MiB of float16 KV (the fast kernels' default) for SmolLM2-135M (23 KB a token) is 17 blocks of 16
# tokens: 272 token slots.
# Speculation off: drafts change how fast each sequence grows (a choice that drafts well can finish before
# its sibling needs the blocks), and these tests need the cache to run out as planned. Speculating
# sequences under preemption: tests/test_speculative_decoding.py.
SMALL_CACHE = ["--kv-cache-mb", "6", "--max-num-seqs", "8", "--speculative", "off"]
MAX_TOKENS = 48  # each request alone: a short prompt + 48 tokens ≈ 4 blocks; all together need twice the cache


def requests() -> list[dict[str, object]]:
    greedy = [{"prompt": f"Story {i}: the {word} went to the", "max_tokens": MAX_TOKENS, "ignore_eos": True,
               "temperature": 0} for i, word in enumerate(("weaver", "miller", "river", "spinner", "town", "loom"))]
    # Seeded sampling with two choices: each choice has its own generator, which preemption must not disturb.
    sampled = {"prompt": "Once upon a time, a spinning wheel", "max_tokens": MAX_TOKENS, "ignore_eos": True,
               "temperature": 0.9, "seed": 1234, "n": 2}
    return [*greedy, sampled]


def texts_of(response: dict[str, object]) -> list[str]:
    return [c["text"] for c in sorted(response["choices"], key=lambda c: c["index"])]  # type: ignore[index,union-attr]


def one_at_a_time(server: TreadleServer, bodies: list[dict[str, object]]) -> list[list[str]]:
    outputs = []
    for body in bodies:
        response = httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=300)
        assert response.status_code == 200, response.text
        outputs.append(texts_of(response.json()))
    return outputs


@pytest.fixture(scope="module")
def server():
    with running_server(SMALL_CACHE) as small:
        assert small.metrics()["treadle_kv_blocks_total"] == 17
        yield small


def test_preemption_keeps_every_request_alive_and_outputs_equal_uncontended_runs(server):
    bodies = requests()
    preemptions = server.metrics()["treadle_preemptions_total"]
    alone = one_at_a_time(server, bodies)
    assert all(text for texts in alone for text in texts)
    assert server.metrics()["treadle_preemptions_total"] == preemptions  # one at a time, nothing is preempted

    streams = [StreamReader(server.base_url, COMPLETIONS, body) for body in bodies]
    together = []
    for body, stream in zip(bodies, streams, strict=True):
        events = stream.finish()
        assert check_sse_events(events, "completion", body.get("n", 1), include_usage=False) == []  # type: ignore[arg-type]
        together.append([stream_text(events, i) for i in range(body.get("n", 1))])  # type: ignore[call-overload]
    assert server.metrics()["treadle_preemptions_total"] > preemptions  # the cache really ran out
    assert together == alone
    server.wait_for_metrics(lambda m: m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0)


def stream_text(events: list[str], index: int) -> str:
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"] if c["index"] == index)


def test_choices_that_only_fit_one_at_a_time_still_complete(server):
    """n=2 with 10 blocks a choice in a 17-block cache: the second choice waits for the first."""
    body = {"prompt": "Two looms", "max_tokens": 150, "ignore_eos": True, "temperature": 0.8, "seed": 5, "n": 2}
    preemptions = server.metrics()["treadle_preemptions_total"]
    response = httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert response.json()["usage"]["completion_tokens"] == 300
    assert server.metrics()["treadle_preemptions_total"] > preemptions
    server.wait_for_metrics(lambda m: m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0)


@pytest.mark.parametrize("body", [
    {"prompt": "A short prompt", "max_tokens": 300},  # prompt + max_tokens > 272 slots
    {"prompt": list(range(1000, 1300)), "max_tokens": 1},  # the prompt alone is larger than the cache
], ids=["max_tokens past the cache", "prompt past the cache"])
def test_a_request_that_could_never_fit_is_refused_with_400_not_queued(server, body):
    response = httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "KV blocks" in error["message"]
    assert server.metrics()["treadle_requests_waiting"] == 0
