"""A client that stops reading its stream stalls nothing and holds a bounded amount of memory: past
`--max-unread-bytes` of unread output its request pauses (keeping its KV blocks) until the client
reads, and one paused past `--slow-reader-timeout-seconds` is aborted; other streams go on."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from bench.soak_checks import check_sse_events
from bench.sse import iter_sse_data

from .conftest_server import read_until
from .reliability import StreamReader, running_server, write_tiny_gguf
from .tinymodel import CHAT_TEMPLATE

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
# The tiny model makes thousands of tokens in a second; 16 choices with 20 alternatives a token make
# ~15 MB of SSE, far past what loopback buffers absorb (4 MiB), so the server's sends really block.
BULKY = {"messages": [{"role": "user", "content": "Write."}], "max_tokens": 480, "n": 16, "ignore_eos": True,
         "logprobs": True, "top_logprobs": 20, "stream": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_gguf(tmp_path_factory.mktemp("slow") / "tiny.gguf", CHAT_TEMPLATE)


def open_unread_stream(port: int, body: dict[str, object]) -> tuple[socket.socket, bytes]:
    """A streamed request on a socket with a small window that nobody reads after the first event."""
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    stuck.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return stuck, read_until(stuck, b"data: ")


def test_a_client_that_stops_reading_pauses_its_request_and_loses_nothing_when_it_reads(tiny_model):
    with running_server(["--model", str(tiny_model), "--slow-reader-timeout-seconds", "300"]) as server:
        stuck, start = open_unread_stream(server.port, BULKY)
        try:
            # Its unread output passed 1 MiB: the request waits, holding its blocks, while others stream.
            server.wait_for_metrics(lambda m: m["treadle_requests_paused"] == 1, timeout=300)
            other = StreamReader(server.base_url, CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 16, "ignore_eos": True})
            assert check_sse_events(other.finish(), "chat", 1, include_usage=False) == []
            paused = server.metrics()
            assert paused["treadle_requests_paused"] == 1 and paused["treadle_kv_blocks_used"] > 0
            # Read at last: the request goes on to its end, and every token arrives — none lost.
            received = start + read_until(stuck, b"data: [DONE]", limit=256 << 20)
            text = dechunk(received.split(b"\r\n\r\n", 1)[1]).decode()
            # split on "\n" only: str.splitlines also breaks at U+2028, \x1c.. that JSON leaves unescaped
            events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
            assert check_sse_events(events, "chat", BULKY["n"], include_usage=False) == []
            num_tokens = sum(len(c["logprobs"]["content"]) for e in events[:-1] for c in json.loads(e)["choices"]
                             if c.get("logprobs"))
            assert num_tokens == BULKY["max_tokens"] * BULKY["n"]
            server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 0 and m["treadle_kv_blocks_used"] == 0)
        finally:
            stuck.close()


def test_a_request_paused_past_the_timeout_is_aborted_and_frees_its_blocks(tiny_model):
    with running_server(["--model", str(tiny_model), "--slow-reader-timeout-seconds", "2"]) as server:
        before = server.metrics()
        stuck, _ = open_unread_stream(server.port, BULKY)
        try:
            aborted = 'treadle_request_success_total{finish_reason="abort_client"}'
            server.wait_for_metrics(lambda m: m.get(aborted, 0) - before.get(aborted, 0) == 1
                                    and m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0,
                                    timeout=120)
            after = server.metrics()
            # ended by the engine (paused too long) or by the stream's send timeout, whichever came first
            assert after["treadle_generation_tokens_total"] < BULKY["max_tokens"] * BULKY["n"]
            assert "read nothing for 2 s" in server.log()
        finally:
            stuck.close()


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (as far as it was read)."""
    payload, position = [], 0
    while (end := body.find(b"\r\n", position)) != -1:
        size = int(body[position:end], 16)
        payload.append(body[end + 2 : end + 2 + size])
        position = end + 2 + size + 2
    return b"".join(payload)


def stream_gaps(base_url: str, max_tokens: int, seconds: float | None = None) -> list[float]:
    """Seconds between consecutive content events of one greedy chat stream, as the client sees them;
    read for at most `seconds` (then the client leaves)."""
    gaps, last, started = [], None, time.monotonic()
    body = {"messages": [{"role": "user", "content": "Tell me about spinning wheels."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", base_url + CHAT, json=body, timeout=120) as response:
        for data in iter_sse_data(response.iter_bytes()):
            if data.startswith("{") and '"content"' in data:
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if seconds is not None and now - started > seconds:
                    break
    return gaps


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def test_32_clients_that_read_nothing_for_a_minute_hold_bounded_memory_and_free_everything():
    """The scenario of issue 14 on the default model and options: 32 streams of up to 4000 tokens whose
    clients read nothing for 60 s beside one client that reads. Memory stays bounded and everything is
    freed once they go. The reader's inter-token gaps are printed, not asserted: in 60 s the 32 streams
    produce less than loopback's socket buffers absorb, so nothing yet tells a client that does not
    read from one that does, and the batch is 33 streams wide (docs/reliability.md). One option is not
    the default: a stream whose client left waits 1 s for a reconnect instead of 30, or the killed
    readers' blocks would sit out that grace before they are freed (tests/test_app_resume.py)."""
    with running_server(["--stream-grace-seconds", "1"]) as server:
        quiet = stream_gaps(server.base_url, 128)
        rss_before = server.metrics()["process_resident_memory_bytes"]
        loaded: list[float] = []
        reading = threading.Thread(target=lambda: loaded.extend(stream_gaps(server.base_url, 3000, seconds=60)))
        reading.start()
        time.sleep(1)  # the reading client is admitted first, so it is never the one preempted
        body = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        readers = [open_unread_stream(server.port, body)[0] for _ in range(32)]
        try:
            reading.join(120)
            metrics = server.metrics()
            rss_growth = metrics["process_resident_memory_bytes"] - rss_before
            # the prefix cache's host-memory tier keeps the KV blocks the pool evicts, up to its own bound:
            # how much of it fills in 60 s depends on the machine's speed, not on the unread streams
            ram_tier = metrics.get('treadle_prefix_cache_tier_bytes{tier="ram"}', 0.0)
            print(f"quiet p50 {statistics.median(quiet) * 1e3:.1f} ms p99 {p99(quiet) * 1e3:.1f} ms; beside 32 "
                  f"unread streams p50 {statistics.median(loaded) * 1e3:.1f} ms p99 {p99(loaded) * 1e3:.1f} ms; "
                  f"paused {metrics['treadle_requests_paused']:.0f}; RSS +{rss_growth / 2**20:.0f} MiB, of which "
                  f"the prefix cache's RAM tier {ram_tier / 2**20:.0f} MiB")
            assert rss_growth - ram_tier < 100 * 2**20
            assert not reading.is_alive() and len(loaded) > 100  # the reading client streamed all along
        finally:
            for reader in readers:
                reader.close()
        server.wait_for_metrics(lambda m: m["treadle_kv_blocks_used"] == 0 and m["treadle_requests_running"] == 0)
