"""What goes over the wire: SSE framing as `curl -N` and httpx-sse see it, msgpack bodies and streams,
/metrics, /openapi.json and /health."""

from __future__ import annotations

import json
import re
import subprocess

import httpx
import msgpack
import openai
import pytest
from httpx_sse import connect_sse

from decoding import DEFAULT_MODEL as MODEL

from .conftest_server import TreadleServer, shared_server

pytestmark = pytest.mark.slow

MSGPACK = "application/msgpack"
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")


def test_curl_sees_data_lines_then_done(server):
    body = json.dumps({**HELLO, "stream": True})
    result = subprocess.run(["curl", "-sN", f"{server.base_url}/v1/chat/completions", "-H",
                             "Content-Type: application/json", "-d", body],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    # Every event is `id: N` and `data: ...` and a blank line (`: ping` comment lines may come between
    # events); the last is [DONE].
    assert re.fullmatch(r"((: ping\n)*id: \d+\ndata: [^\n]+\n\n)*(: ping\n)*data: \[DONE\]\n\n", result.stdout), \
        result.stdout
    ids = [int(line[4:]) for line in result.stdout.splitlines() if line.startswith("id: ")]
    assert ids == list(range(len(ids))) and ids  # what a reconnect names in Last-Event-ID
    chunks = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)


def test_httpx_sse_reads_completion_events_with_stream_headers(server):
    with httpx.Client(timeout=120) as client, connect_sse(
        client, "POST", f"{server.base_url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "stream": True},
    ) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        assert source.response.headers["cache-control"] == "no-store"
        assert source.response.headers["x-accel-buffering"] == "no"  # nginx: do not buffer the stream
        data = [event.data for event in source.iter_sse()]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(" Paris")


def test_msgpack_request_and_streamed_msgpack_maps_end_with_done(server):
    body = msgpack.packb({**HELLO, "stream": True})
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    unpacker = msgpack.Unpacker(raw=False)
    maps = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", content=body, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"] == MSGPACK
        for data in response.iter_bytes():
            unpacker.feed(data)
            maps.extend(unpacker)
    assert maps[-1] == {"done": True}
    chunks = maps[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", content=msgpack.packb(HELLO), headers=headers,
                       timeout=120)
    assert whole.headers["content-type"] == MSGPACK
    reply = msgpack.unpackb(whole.content)
    assert reply["choices"][0]["message"]["content"] == "".join(c["choices"][0]["delta"].get("content", "")
                                                                for c in chunks)


def test_msgpack_client_gets_its_errors_in_msgpack(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"\xc1\xc1",
                          headers={"Content-Type": MSGPACK, "Accept": MSGPACK})
    assert response.status_code == 400
    assert msgpack.unpackb(response.content)["error"]["code"] == "invalid_msgpack"


def test_metrics_count_tokens_requests_and_latencies(server):
    before = server.metrics()
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=HELLO, timeout=120).json()
    usage = reply["usage"]
    after = server.wait_for_metrics(lambda m: m['treadle_request_success_total{finish_reason="length"}']
                                    > before.get('treadle_request_success_total{finish_reason="length"}', 0))
    assert after["treadle_prompt_tokens_total"] - before["treadle_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["treadle_generation_tokens_total"] - before["treadle_generation_tokens_total"] == 6
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "step"):
        name = f"treadle_{histogram}_seconds_count"
        assert after[name] > before[name], name
    assert after["treadle_kv_blocks_total"] > 0
    for name in ("treadle_requests_running", "treadle_requests_waiting", "treadle_kv_blocks_used",
                 "treadle_preemptions_total", "treadle_requests_rejected_total"):
        assert name in after


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server):
    before = server.metrics()["treadle_prefix_cache_hit_tokens_total"]
    replies = [httpx.post(f"{server.base_url}/v1/chat/completions", json=HELLO, timeout=120).json() for _ in range(2)]
    cached = replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16  # at least one full block of the shared prompt
    server.wait_for_metrics(lambda m: m["treadle_prefix_cache_hit_tokens_total"] >= before + cached)


def test_openapi_describes_every_route_with_resolvable_schemas(server):
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
            "/metrics"} <= set(schema["paths"])
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs and refs <= set(schema["components"]["schemas"])
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "max_completion_tokens" in chat["properties"]


def test_health_is_ok_once_ready(server):
    response = httpx.get(f"{server.base_url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_nothing_follows_done_on_an_sse_stream_even_with_pings_every_few_milliseconds(tmp_path):
    """sse-starlette's ping task could write `: ping` between `data: [DONE]` and the end of the response."""
    from tests.reliability import running_server, write_tiny_gguf
    from tests.tinymodel import CHAT_TEMPLATE

    model = write_tiny_gguf(tmp_path / "tiny.gguf", CHAT_TEMPLATE)
    with running_server(["--model", str(model), "--sse-ping-seconds", "0.002"]) as server:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
        for _ in range(60):
            response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
        # Once events carry ids, a client that keeps the last id (as the openai package does, against the
        # spec) dispatches an empty event at every blank line: pings must not end with one.
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        for _ in range(10):
            chunks = list(client.chat.completions.create(model=name, messages=body["messages"],
                                                         max_tokens=24, stream=True))
            assert chunks[-1].choices[0].finish_reason is not None
