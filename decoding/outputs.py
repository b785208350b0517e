"""What the engine hands back to callers: per-choice deltas, merged while the reader lags."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from .sampling import TokenLogprobs


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """A delta of one choice of one request. `finish_reason` is set on the choice's last delta."""

    request_id: str
    index: int  # choice index (0 .. n-1)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None
    usage: Usage | None = None  # on the last delta of the request
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first delta only, when asked

    def merge(self, later: RequestOutput) -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        for name in ("finish_reason", "stop_reason", "error", "usage"):
            value = getattr(later, name)
            if value is not None:
                setattr(self, name, value)


class RequestStream:
    """One request's outputs: the engine thread puts without blocking, one reader takes.

    If the reader falls behind, deltas of the same choice merge, so a slow client costs memory
    proportional to its unread text, never a queue of events, and never blocks the engine.
    Readable from asyncio (`async for`) or from a plain thread (`for`).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._async_ready = asyncio.Event() if loop is not None else None
        self._pending: dict[int, RequestOutput] = {}
        self._finished = False  # the engine put the request's last output
        self._drained = False  # the reader took it

    # engine side
    def put(self, output: RequestOutput, is_last: bool = False) -> None:
        with self._lock:
            pending = self._pending.get(output.index)
            if pending is None:
                self._pending[output.index] = output
            else:
                pending.merge(output)
            self._finished = self._finished or is_last
            self._ready.notify()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_ready.set)  # type: ignore[union-attr]
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

    # reader side
    def _take(self) -> tuple[list[RequestOutput], bool]:
        outputs = [self._pending[i] for i in sorted(self._pending)]
        self._pending.clear()
        return outputs, self._finished

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async_ready is not None, "this stream was created for a thread reader"
        while not self._drained:
            await self._async_ready.wait()
            self._async_ready.clear()
            with self._lock:
                outputs, self._drained = self._take()
            for output in outputs:
                yield output

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._drained:
            with self._lock:
                while not self._pending and not self._finished:
                    self._ready.wait()
                outputs, self._drained = self._take()
            yield from outputs

    @property
    def is_finished(self) -> bool:
        return self._finished
