"""A client that stops reading its stream stalls nothing: the engine finishes its request and frees its
blocks (undelivered deltas merge in the request's stream), and other clients' streams go on."""

from __future__ import annotations

import json
import socket

import pytest

from app.bench_soak import check_sse_events

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
def server(tmp_path_factory: pytest.TempPathFactory):
    model = write_tiny_gguf(tmp_path_factory.mktemp("slow") / "tiny.gguf", CHAT_TEMPLATE)
    with running_server(["--model", str(model)]) as tiny:
        yield tiny


def test_a_client_that_never_reads_stalls_neither_the_engine_nor_other_streams(server):
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, and nobody reading it
    stuck.connect(("127.0.0.1", server.port))
    body = json.dumps(BULKY).encode()
    stuck.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        start = read_until(stuck, b"data: ")  # the stream has started; from here on nothing is read
        other = StreamReader(server.base_url, CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 16, "ignore_eos": True})
        assert check_sse_events(other.finish(), "chat", 1, include_usage=False) == []
        # The engine ran the unread request to its end: nothing running, every block back.
        server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 0 and m["treadle_kv_blocks_used"] == 0,
                                timeout=300)
        # Read at last: every token arrived — deltas merged while nobody read, none lost.
        received = start + read_until(stuck, b"data: [DONE]", limit=256 << 20)
        text = dechunk(received.split(b"\r\n\r\n", 1)[1]).decode()
        # split on "\n" only: str.splitlines also breaks at U+2028, \x1c.. that JSON leaves unescaped
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        assert check_sse_events(events, "chat", BULKY["n"], include_usage=False) == []
        num_tokens = sum(len(c["logprobs"]["content"]) for e in events[:-1] for c in json.loads(e)["choices"]
                         if c.get("logprobs"))
        assert num_tokens == BULKY["max_tokens"] * BULKY["n"]
        # ~10 MB (less when deltas merged), past the ~4.1 MB that kernel and asyncio buffers can hold:
        # the relay did wait on the client while the engine finished
        assert len(received) > 6 << 20
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
