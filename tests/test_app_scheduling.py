"""Requests that wait their turn, over HTTP: priority (the body's field or --priority-header) decides who
is admitted first under a full queue, and a request still queued past its timeout is answered 503
with Retry-After (an error event once its stream has begun) and counted."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from bench.sse import iter_sse_data

from .reliability import running_server

QUESTION = [{"role": "user", "content": "Write a long story about a weaver."}]


@pytest.fixture(scope="module")
def server():
    # two sequences at a time: the rest of a burst waits, and admission order is what is tested
    with running_server(["--max-num-seqs", "2", "--max-queue", "64", "--kv-cache-mb", "64",
                         "--priority-header", "X-Priority", "--queue-timeout-seconds", "600",
                         "--stream-grace-seconds", "0"]) as server:  # a client that leaves ends its stream
        yield server


def stream_first_token_time(base_url: str, body: dict, headers: dict | None, out: dict, key: str) -> None:
    """Record when the stream's first content arrives (time.monotonic())."""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for data in iter_sse_data(response.iter_bytes()):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and key not in out:
                out[key] = time.monotonic()


def test_a_high_priority_request_behind_30_low_ones_gets_its_first_token_before_them(server):
    first_tokens: dict[str, float] = {}
    low = {"messages": QUESTION, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": True,
           "priority": 10}
    threads = [threading.Thread(target=stream_first_token_time,
                                args=(server.base_url, low, None, first_tokens, f"low{i}"))
               for i in range(30)]
    for thread in threads:
        thread.start()
    server.wait_for_metrics(lambda m: m["treadle_requests_waiting"] >= 20)
    started_before = len(first_tokens)
    high = {k: v for k, v in low.items() if k != "priority"}  # from the header: a front end that cannot add fields
    stream_first_token_time(server.base_url, high, {"X-Priority": "-5"}, first_tokens, "high")
    for thread in threads:
        thread.join()
    assert len(first_tokens) == 31
    overtaken = [k for k, t in first_tokens.items() if k != "high" and t > first_tokens["high"]]
    # only those already admitted when it arrived (and a step's worth of racing) went first
    assert len(overtaken) >= 30 - started_before - 3, (started_before, sorted(first_tokens.values()))


def test_a_priority_header_that_is_not_an_integer_is_refused(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"X-Priority": "high"},
                          json={"messages": QUESTION, "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Priority"
    response = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={"messages": QUESTION, "max_tokens": 1, "priority": "high"})
    assert response.status_code == 400 and "priority" in response.json()["error"]["param"]


def test_a_request_queued_past_its_timeout_gets_503_or_an_error_event_and_is_counted(server):
    busy = {"messages": QUESTION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    started = threading.Event()
    stop = threading.Event()

    def occupy() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=busy, timeout=300) as response:
            for _ in iter_sse_data(response.iter_bytes()):
                started.set()
                if stop.is_set():
                    break

    holders = [threading.Thread(target=occupy) for _ in range(2)]  # both sequences taken
    for holder in holders:
        holder.start()
    try:
        server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 2)
        before = server.metrics().get("treadle_queue_timeouts_total", 0)
        late = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={"messages": QUESTION, "max_tokens": 4, "timeout": 0.5}, timeout=60)
        assert late.status_code == 503 and late.headers["Retry-After"]
        assert late.json()["error"]["code"] == "queue_timeout"
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                          json={"prompt": "Once", "max_tokens": 4, "timeout": 0.5, "stream": True}) as response:
            events = list(iter_sse_data(response.iter_bytes()))
        assert json.loads(events[-2])["error"]["code"] == "queue_timeout" and events[-1] == "[DONE]"
        server.wait_for_metrics(lambda m: m.get("treadle_queue_timeouts_total", 0) == before + 2)
    finally:
        stop.set()
        for holder in holders:
            holder.join()
