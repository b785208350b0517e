"""Requests with many choices (n > 1) under load: each choice is a sequence of its own, so admission
counts all n against max_num_seqs and no step ever holds more decodes than its token budget. Valid
input never makes a 5xx, for the request itself or for anyone sharing its steps."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest_server import shared_server
from .reliability import running_server

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
NUM_REQUESTS, N = 24, 16


def wide_request(i: int) -> dict[str, object]:
    return {"prompt": f"Story {i}: the weaver", "n": N, "max_tokens": 16, "temperature": 0.8, "seed": i,
            "ignore_eos": True}


@pytest.mark.parametrize("options", [[], ["--max-num-seqs", "32"]], ids=["defaults", "max-num-seqs-32"])
def test_many_concurrent_requests_with_16_choices_all_answer_in_full(options):
    with running_server(options) as server:
        def post(i: int) -> httpx.Response:
            return httpx.post(f"{server.base_url}{COMPLETIONS}", json=wide_request(i), timeout=600)

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            responses = list(pool.map(post, range(NUM_REQUESTS)))
        assert [r.status_code for r in responses] == [200] * NUM_REQUESTS, [
            r.text for r in responses if r.status_code != 200]
        for response in responses:
            choices = response.json()["choices"]
            assert sorted(c["index"] for c in choices) == list(range(N))
            assert all(c["finish_reason"] == "length" and c["text"] for c in choices)
            assert response.json()["usage"]["completion_tokens"] == N * 16
        server.wait_for_metrics(lambda m: m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0)


def test_more_choices_than_the_server_runs_together_is_a_400_naming_n():
    server = shared_server("main")  # --max-num-seqs 8
    response = httpx.post(f"{server.base_url}{COMPLETIONS}", json={"prompt": "Hi", "n": 9, "max_tokens": 4},
                          timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and "at most 8" in error["message"]
