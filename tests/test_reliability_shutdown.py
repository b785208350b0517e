"""Graceful shutdown of a real `treadle serve`: on SIGTERM new generation requests get 503 while those in
flight run on for --shutdown-grace-seconds; what is left is ended with an error event; exit status 0."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.soak_checks import check_sse_events

from .conftest_server import TreadleServer
from .reliability import StreamReader, running_server

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Thousands of tokens: minutes of decoding, far past any grace period used here.
ENDLESS = {"prompt": "Count to ten thousand: 1, 2, 3,", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
ENDLESS_CHAT = {"messages": [{"role": "user", "content": "Count to ten thousand."}], "max_tokens": 4000,
                "ignore_eos": True}
SHORT_CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32, "ignore_eos": True}
EXIT_TIMEOUT_S = 120  # bounds a failing test only


def wait_until_draining(server: TreadleServer) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.base_url}/health", timeout=10).json().get("status") != "draining":
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.02)


def assert_ended_with_shutdown_error(events: list[str]) -> None:
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable_error"
    assert len(events) > 2  # tokens were streamed before the end


def test_sigterm_refuses_new_work_lets_short_requests_finish_and_ends_the_rest_with_an_error():
    with running_server(["--shutdown-grace-seconds", "6", "--max-num-seqs", "4"]) as server:
        endless = StreamReader(server.base_url, COMPLETIONS, ENDLESS).wait_events()
        # a non-streamed request in flight too: it can only answer once, so it answers 503
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{server.base_url}{COMPLETIONS}", json=ENDLESS, timeout=300)
            server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 2)
            short = StreamReader(server.base_url, CHAT, SHORT_CHAT).wait_events(2)  # role, then a token
            server.process.send_signal(signal.SIGTERM)
            wait_until_draining(server)

            refused = httpx.post(f"{server.base_url}{CHAT}", json=SHORT_CHAT, timeout=30)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"
            assert refused.headers["connection"] == "close" and refused.headers["retry-after"] == "1"
            assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 200  # still answering

            assert server.process.wait(EXIT_TIMEOUT_S) == 0
            response = whole.result()
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        assert check_sse_events(short.finish(), "chat", 1, include_usage=False) == []
        assert_ended_with_shutdown_error(endless.finish())
        log = server.log()
        assert "draining: 3 request(s) in flight" in log and "ending 2 request(s) still in flight" in log
        with pytest.raises(httpx.ConnectError):  # after the drain the listener is closed
            httpx.get(f"{server.base_url}/health", timeout=5)


def test_a_second_signal_ends_the_grace_period_at_once():
    with running_server(["--shutdown-grace-seconds", "3600"]) as server:
        endless = StreamReader(server.base_url, CHAT, ENDLESS_CHAT).wait_events()
        server.process.send_signal(signal.SIGTERM)
        wait_until_draining(server)
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(EXIT_TIMEOUT_S) == 0  # an hour of grace, cut short
        assert_ended_with_shutdown_error(endless.finish())


def test_an_idle_server_exits_0_on_ctrl_c():
    with running_server([]) as server:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(EXIT_TIMEOUT_S) == 0
        assert "Traceback" not in server.log()
