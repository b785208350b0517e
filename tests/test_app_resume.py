"""Streams that survive their connection: a chat or completion stream cut by closing the socket is
resumed with Last-Event-ID and yields exactly what an uncut stream yields; one nobody reconnects to is
aborted after the grace period; one that is cancelled stops."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import msgpack
import pytest

from bench.sse import SSEDecoder

from .conftest_server import TreadleServer, shared_server

ABORTED = 'treadle_request_success_total{finish_reason="abort_client"}'


@pytest.fixture(scope="module")
def server() -> TreadleServer:
    return shared_server("main")  # --stream-grace-seconds 3


def chat_body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
            "max_tokens": 48, "ignore_eos": True, "stream": True, **extra}


def read_events(chunks: Iterator[bytes], decoder: SSEDecoder, stop_after: int | None = None,
                stop_at: Callable[[str], bool] | None = None) -> list[tuple[int | None, str]]:
    """(event id, data) of each event, up to `stop_after` events or the first whose data `stop_at` accepts
    (then the caller cuts the connection)."""
    events: list[tuple[int | None, str]] = []
    for chunk in chunks:
        for data in decoder.feed(chunk):
            event_id = decoder.event_ids[len(decoder.event_types) - 1]
            events.append((None if event_id is None else int(event_id), data))
            if stop_at is not None and stop_at(data):
                return events
        if stop_after is not None and len(events) >= stop_after:
            break
    return events


def chat_text(events: list[tuple[int | None, str]]) -> str:
    chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
    assert not [c for c in chunks if "error" in c], chunks
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def uncut(server: TreadleServer, path: str, body: dict) -> list[tuple[int | None, str]]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        return read_events(response.iter_raw(), SSEDecoder())


def cut_then_resume(server: TreadleServer, path: str, body: dict, cut_after: int) -> tuple[list, list, str]:
    """Read `cut_after` events, close the socket, reconnect with the last id seen; (before, after, id)."""
    client = httpx.Client(timeout=120)
    with client.stream("POST", server.base_url + path, json=body) as response:
        before = read_events(response.iter_raw(), SSEDecoder(), stop_after=cut_after)
        stream_id = json.loads(before[0][1])["id"]
    client.close()  # the connection is closed mid-answer, not returned to a pool
    last_id = before[-1][0]
    with httpx.stream("GET", f"{server.base_url}{path}/{stream_id}/stream", headers={"Last-Event-ID": str(last_id)},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        after = read_events(response.iter_raw(), SSEDecoder())
    return before, after, stream_id


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_chat_stream_cut_mid_answer_and_resumed_yields_the_uncut_text(server, sampling):
    body = chat_body(**sampling)
    whole = uncut(server, "/v1/chat/completions", body)
    before, after, _ = cut_then_resume(server, "/v1/chat/completions", body, cut_after=6)
    ids = [event_id for event_id, data in before + after if data != "[DONE]"]
    assert ids == list(range(len(ids))), "every event exactly once, in order"
    assert after[-1][1] == "[DONE]"
    assert chat_text(before + after) == chat_text(whole) and len(chat_text(whole)) > 40


def test_a_completion_stream_resumes_too_and_a_reconnect_without_an_id_replays_it_all(server):
    body = {"prompt": "The history of the lighthouse begins", "max_tokens": 32, "ignore_eos": True,
            "temperature": 0, "stream": True}
    whole = uncut(server, "/v1/completions", body)
    before, after, stream_id = cut_then_resume(server, "/v1/completions", body, cut_after=3)

    def text(events: list) -> str:
        return "".join(json.loads(d)["choices"][0]["text"] for _, d in events if d != "[DONE]")

    assert text(before + after) == text(whole)
    # read to its end, the stream is gone: the id no longer answers
    assert httpx.get(f"{server.base_url}/v1/completions/{stream_id}/stream").status_code == 404


def test_a_reconnect_while_the_first_connection_still_reads_gets_the_same_events(server):
    body = chat_body(temperature=0, max_tokens=24)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as first:
        decoder, chunks = SSEDecoder(), first.iter_raw()
        head = read_events(chunks, decoder, stop_after=2)
        stream_id = json.loads(head[0][1])["id"]
        with httpx.stream("GET", f"{server.base_url}/v1/chat/completions/{stream_id}/stream",
                          timeout=120) as second:  # no Last-Event-ID: from the first event
            replay = read_events(second.iter_raw(), SSEDecoder())
        rest = read_events(chunks, decoder)
    assert chat_text(replay) == chat_text(head + rest)


def test_a_stream_nobody_reconnects_to_is_aborted_after_the_grace_period(server):
    aborted = server.metrics().get(ABORTED, 0)
    client = httpx.Client(timeout=120)
    with client.stream("POST", server.base_url + "/v1/chat/completions",
                       json=chat_body(max_tokens=2000, temperature=0)) as response:
        read_events(response.iter_raw(), SSEDecoder(), stop_after=3)
    client.close()
    # paused during the grace period (3 s): its KV kept for a reconnect, no token made for nobody
    server.wait_for_metrics(lambda m: m["treadle_requests_paused"] == 1)
    paused = server.metrics()
    time.sleep(1.0)
    still = server.metrics()
    assert still["treadle_requests_running"] == 1 and still["treadle_kv_blocks_used"] > 0
    assert still["treadle_step_seconds_count"] == paused["treadle_step_seconds_count"], "steps ran for nobody"
    # aborted and released after it
    server.wait_for_metrics(lambda m: m.get(ABORTED, 0) == aborted + 1 and m["treadle_kv_blocks_used"] == 0
                            and m["treadle_requests_running"] == 0)


def test_a_reconnect_during_the_grace_resumes_the_paused_generation(server):
    # long enough to be mid-answer when the disconnect is seen (exact kernels make ~20 tokens/s here), so
    # it pauses rather than ends
    body = chat_body(max_tokens=160, temperature=0)
    whole = chat_text(uncut(server, "/v1/chat/completions", body))
    client = httpx.Client(timeout=120)
    with client.stream("POST", server.base_url + "/v1/chat/completions", json=body) as response:
        before = read_events(response.iter_raw(), SSEDecoder(), stop_after=4)
    client.close()
    server.wait_for_metrics(lambda m: m["treadle_requests_paused"] == 1)
    stream_id = json.loads(before[0][1])["id"]
    with httpx.stream("GET", f"{server.base_url}/v1/chat/completions/{stream_id}/stream",
                      headers={"Last-Event-ID": str(before[-1][0])}, timeout=120) as response:
        after = read_events(response.iter_raw(), SSEDecoder())
    assert after[-1][1] == "[DONE]" and chat_text(before + after) == whole


def test_cancel_ends_a_stream_now_and_bad_resumes_are_refused(server):
    with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                      json=chat_body(max_tokens=2000, temperature=0), timeout=120) as response:
        decoder, chunks = SSEDecoder(), response.iter_raw()
        head = read_events(chunks, decoder, stop_after=2)
        stream_id = json.loads(head[0][1])["id"]
        base = f"{server.base_url}/v1/chat/completions/{stream_id}"
        bad = httpx.get(f"{base}/stream", headers={"Last-Event-ID": "not-a-number"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        assert httpx.get(f"{base}/stream", headers={"Last-Event-ID": "-5"}).status_code == 400
        assert httpx.get(f"{server.base_url}/v1/completions/{stream_id}/stream").status_code == 404  # a chat id
        cancelled = httpx.post(f"{base}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        rest = read_events(chunks, decoder)
    last = json.loads(rest[-2][1])
    assert last["choices"][0]["finish_reason"] == "abort" and rest[-1][1] == "[DONE]"
    assert httpx.get(f"{server.base_url}/v1/chat/completions/chatcmpl-unknown/stream").status_code == 404


def test_a_msgpack_stream_resumes_too_counting_the_maps_read(server):
    """Map k of a msgpack stream is event k: a client that read k maps resumes with Last-Event-ID k-1."""
    body = {"prompt": "The history of the lighthouse begins", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}
    headers = {"Accept": "application/msgpack"}

    def maps(response: httpx.Response, limit: int | None = None) -> list[dict]:
        unpacker, read = msgpack.Unpacker(), []
        for data in response.iter_raw():
            unpacker.feed(data)
            read += list(unpacker)
            if limit is not None and len(read) >= limit:
                return read[:limit]
        return read

    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
        whole = maps(r)
    client = httpx.Client(timeout=120)
    with client.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers) as r:
        head = maps(r, limit=4)
    client.close()
    with httpx.stream("GET", f"{server.base_url}/v1/completions/{head[0]['id']}/stream", timeout=120,
                      headers={**headers, "Last-Event-ID": str(len(head) - 1)}) as r:
        rest = maps(r)

    def text(chunks: list[dict]) -> str:
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))

    assert rest[-1] == {"done": True} and text(head + rest) == text(whole)
