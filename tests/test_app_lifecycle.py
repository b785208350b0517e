"""Clients that leave, floods, pings while queued, auth, CORS, and how `treadle serve` starts and fails.

Every wait here polls /metrics until a condition holds; timeouts only bound a failing test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from decoding import DEFAULT_MODEL as MODEL

from .conftest_server import (
    API_KEY,
    CORS_ORIGIN,
    REPO,
    TreadleServer,
    raw_request,
    read_until,
    server_env,
    shared_server,
)

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
ABORTED = 'treadle_request_success_total{finish_reason="abort_client"}'
CONTENT_CHUNK = b'"delta":{"content":'  # a token arrived (the role chunk has "role" first)


def long_chat(stream: bool) -> bytes:
    """A request that would run for minutes if nothing stopped it."""
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                       "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": stream}).encode()


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")


@pytest.fixture(scope="module")
def guarded() -> TreadleServer:
    return shared_server("guarded")


def assert_released(server: TreadleServer, num_aborted: float) -> None:
    """The vanished client's request ended as "abort" and every KV block came back."""
    server.wait_for_metrics(lambda m: m.get(ABORTED, 0) == num_aborted and m["treadle_kv_blocks_used"] == 0
                            and m["treadle_requests_running"] == 0 and m["treadle_requests_waiting"] == 0)


def test_sse_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(server):
    aborted = server.metrics().get(ABORTED, 0)
    sock = raw_request(server.port, CHAT, long_chat(stream=True))
    read_until(sock, CONTENT_CHUNK)
    assert server.metrics()["treadle_kv_blocks_used"] > 0
    sock.close()
    assert_released(server, aborted + 1)


def test_msgpack_stream_client_that_disconnects_is_aborted(server):
    aborted = server.metrics().get(ABORTED, 0)
    sock = raw_request(server.port, CHAT, long_chat(stream=True), {"Accept": "application/msgpack"})
    read_until(sock, b"\r\n\r\n")  # the response has started
    server.wait_for_metrics(lambda m: m["treadle_generation_tokens_total"] >= 0 and m["treadle_kv_blocks_used"] > 0)
    sock.close()
    assert_released(server, aborted + 1)


def test_non_streaming_client_that_disconnects_is_aborted(server):
    """starlette never cancels a plain request; the route's own disconnect watcher must."""
    aborted = server.metrics().get(ABORTED, 0)
    sock = raw_request(server.port, CHAT, long_chat(stream=False))
    server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 1 and m["treadle_kv_blocks_used"] > 0)
    sock.close()
    assert_released(server, aborted + 1)


def test_queued_stream_gets_pings_and_is_aborted_when_its_client_leaves(guarded):
    auth = guarded.headers
    aborted = guarded.metrics().get(ABORTED, 0)
    running = raw_request(guarded.port, CHAT, long_chat(stream=True), auth)
    read_until(running, CONTENT_CHUNK)
    queued = raw_request(guarded.port, CHAT, long_chat(stream=True), auth)  # max-num-seqs 1: it waits
    received = read_until(queued, b": ping\n")
    assert CONTENT_CHUNK not in received  # pinged while still waiting for its first token
    guarded.wait_for_metrics(lambda m: m["treadle_requests_waiting"] == 1)
    queued.close()
    guarded.wait_for_metrics(lambda m: m.get(ABORTED, 0) == aborted + 1 and m["treadle_requests_waiting"] == 0
                             and m["treadle_requests_running"] == 1)
    running.close()
    assert_released(guarded, aborted + 2)


def test_a_flood_gets_429_with_retry_after_and_never_a_5xx(guarded):
    rejected = guarded.metrics()["treadle_requests_rejected_total"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def send(i: int) -> httpx.Response:
        return httpx.post(f"{guarded.base_url}{CHAT}", json={**body, "stream": i % 2 == 1}, headers=guarded.headers,
                          timeout=300)

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(send, range(32)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")
    guarded.wait_for_metrics(lambda m: m["treadle_requests_rejected_total"] - rejected == statuses.count(429)
                             and m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0)


def test_api_key_is_required_on_the_api_but_not_on_probes(guarded):
    url = f"{guarded.base_url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{guarded.base_url}/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.get(url, headers=guarded.headers).status_code == 200
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200
    assert httpx.get(f"{guarded.base_url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL


def test_the_bearer_scheme_is_matched_case_insensitively(guarded):
    """RFC 7235 §2.1: the auth scheme is a case-insensitive token; the key itself is compared exactly."""
    url = f"{guarded.base_url}/v1/models"
    for scheme in ("bearer", "BEARER", "BeArEr"):
        assert httpx.get(url, headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200, scheme
    for header in (f"Bearer {API_KEY.upper()}", f"Basic {API_KEY}", f"Bearer{API_KEY}", f"Bearer {API_KEY}x"):
        assert httpx.get(url, headers={"Authorization": header}).status_code == 401, header


def test_cors_preflight_and_responses_allow_the_configured_origin_only(guarded):
    preflight = {"Origin": CORS_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    response = httpx.options(f"{guarded.base_url}{CHAT}", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == CORS_ORIGIN
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    assert "POST" in response.headers["access-control-allow-methods"]
    other = httpx.options(f"{guarded.base_url}{CHAT}", headers={**preflight, "Origin": "http://evil.test"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    unauthorized = httpx.get(f"{guarded.base_url}/v1/models", headers={"Origin": CORS_ORIGIN})
    assert unauthorized.status_code == 401  # and the browser may read why:
    assert unauthorized.headers["access-control-allow-origin"] == CORS_ORIGIN


def run_serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.cli", "serve", *args], cwd=REPO, env={**server_env(), **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_unknown_model_exits_2_with_one_line(tmp_path):
    result = run_serve("--model", str(tmp_path / "missing.gguf"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "missing.gguf" in errors[0]
    assert "Traceback" not in result.stderr


def test_options_are_read_from_treadle_environment_variables(tmp_path):
    result = run_serve(TREADLE_MODEL=str(tmp_path / "from-env.gguf"))
    assert result.returncode == 2 and "from-env.gguf" in result.stderr
    bad = run_serve(TREADLE_PORT="eighty")
    assert bad.returncode == 2 and "--port" in bad.stderr
    assert "TREADLE_MAX_QUEUE" in run_serve("--help").stdout


@pytest.mark.skipif(not os.path.exists("/usr/bin/curl"), reason="needs curl")
def test_curl_no_buffer_streams_tokens_of_a_completion(server):
    result = subprocess.run(["curl", "-sN", f"{server.base_url}/v1/completions", "-d",
                             json.dumps({"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "stream": True})],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.rstrip().endswith("data: [DONE]")


def test_chat_command_keeps_the_conversation_and_quits_at_end_of_input():
    result = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--temperature", "0", "--max-tokens", "24",
                             "--kernels", "exact"],
                            cwd=REPO, env=server_env(), input="What is the capital of France?\n/reset\n",
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and result.stdout.count("> ") == 3  # a question, /reset, then end of input
