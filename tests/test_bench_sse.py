"""bench/sse.py: events read from bytes as the SSE spec splits them, wherever the chunks break."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from bench.sse import SSEDecoder, aiter_sse_data, iter_sse_data

# U+2028, U+2029 and NEL are legal unescaped in JSON and are line ends to str.splitlines (and httpx's
# iter_lines); CRLF, CR and LF are the only line ends of SSE.
PAYLOAD = ('data: {"t":"a\u2028b\u2029c\x85d\x1ce"}\r\n\r\n'
           ": ping\r\n\r\n"
           "data:first\ndata: second\n\n"
           "event: x\rid: 7\rdata: [DONE]\r\r"
           "data: cut off").encode()
EVENTS = ['{"t":"a\u2028b\u2029c\x85d\x1ce"}', "first\nsecond", "[DONE]"]


def test_events_end_only_at_blank_lines_of_cr_lf_or_crlf():
    assert list(iter_sse_data([PAYLOAD])) == EVENTS


def test_chunk_boundaries_change_nothing_even_inside_a_crlf_or_a_character():
    for i in range(len(PAYLOAD) + 1):
        assert list(iter_sse_data([PAYLOAD[:i], b"", PAYLOAD[i:]])) == EVENTS, i
    assert list(iter_sse_data(PAYLOAD[i:i + 1] for i in range(len(PAYLOAD)))) == EVENTS


def test_ids_and_event_types_are_read_and_unknown_fields_kept_for_a_checker():
    decoder = SSEDecoder()
    events = decoder.feed(b"retry: 5\n\n" + PAYLOAD)
    assert decoder.last_event_id == "7" and decoder.other_lines == ["retry: 5"]
    assert len(decoder.event_types) == len(events) and "x" in decoder.event_types


def test_the_async_reader_gives_the_same_events():
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(PAYLOAD), 5):
            yield PAYLOAD[i:i + 5]

    async def read() -> list[str]:
        return [data async for data in aiter_sse_data(chunks())]

    assert asyncio.run(read()) == EVENTS
