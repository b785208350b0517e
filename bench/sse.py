"""Server-sent events read from the bytes of a response, as the SSE spec defines them (WHATWG HTML,
"Interpreting an event stream"): a line ends at CRLF, LF or CR, and a blank line ends an event.

The split is done on bytes, never with `str.splitlines` (or httpx's `iter_lines`, which splits like it):
those also end a line at U+2028, U+2029, NEL (\\x85) and \\x1c-\\x1e, which JSON leaves unescaped inside a
string, so a token carrying one would cut a `data:` payload in two. In UTF-8 none of those contains a CR
or LF byte, and a CR or LF byte is never part of a longer character, so splitting bytes is exact.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    """Feed it the response's bytes as they arrive; it returns the `data` of each event completed
    (multi-line data joined with "\\n"). `last_event_id` is the latest `id:` field (what a client sends as
    Last-Event-ID when it reconnects); `event_ids` and `event_types` hold, for each event returned, the
    last event id then and its `event:` field (None where there was none). Comments (`: ping`) are skipped;
    lines that are none of these nor blank are kept in `other_lines` for a checker that expects none."""

    def __init__(self) -> None:
        self._buffer = b""  # the unfinished line
        self._after_cr = False  # the last chunk ended with CR: a LF first in the next one ends no line
        self._data: list[str] | None = None  # the data lines of the event being read, None before any
        self._event_type: str | None = None
        self.last_event_id: str | None = None
        self.event_ids: list[str | None] = []
        self.event_types: list[str | None] = []
        self.other_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        if not chunk:
            return []
        if self._after_cr and chunk.startswith(b"\n"):  # the second half of a CRLF split across chunks
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        *lines, self._buffer = _LINE_END.split(self._buffer + chunk)
        return [data for line in lines if (data := self._line(line.decode())) is not None]

    def _line(self, line: str) -> str | None:
        if line == "":
            data, self._data = self._data, None
            event_type, self._event_type = self._event_type, None
            if data is None:
                return None
            self.event_ids.append(self.last_event_id)
            self.event_types.append(event_type)
            return "\n".join(data)
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data = [*(self._data or []), value]
        elif field == "id" and "\0" not in value:  # the spec ignores an id holding NUL
            self.last_event_id = value
        elif field == "event":
            self._event_type = value
        elif field:  # "" is a comment
            self.other_lines.append(line)
        return None


def iter_sse_data(chunks: Iterable[bytes]) -> Iterator[str]:
    """The `data` of each event of a stream, e.g. `iter_sse_data(response.iter_bytes())`. An event cut
    off by the end of the stream (no blank line after it) is dropped, as the spec says."""
    decoder = SSEDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)


async def aiter_sse_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """`iter_sse_data` for an async stream, e.g. `aiter_sse_data(response.aiter_bytes())`."""
    decoder = SSEDecoder()
    async for chunk in chunks:
        for data in decoder.feed(chunk):
            yield data
