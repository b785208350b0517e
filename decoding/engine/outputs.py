"""What the engine hands back to callers: per-choice deltas, merged while the reader lags."""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from .sampling import TokenLogprobs


class FinishReason(enum.StrEnum):
    """Why a choice ended. The API layer maps each to what its protocol says (app/outcomes.py)."""

    STOP = "stop"  # end of sequence, a stop string or token, or the grammar complete
    LENGTH = "length"  # max_tokens, or the context full
    TOOL_CALLS = "tool_calls"  # the answer is tool calls (told by the API layer, which parses them)
    ABORT_CLIENT = "abort_client"  # its client cancelled, left, or stopped reading
    ABORT_SHUTDOWN = "abort_shutdown"  # the engine shut down under it
    ERROR = "error"  # the engine failed it (a fault in its step, a grammar dead end)
    TIMEOUT = "timeout"  # it waited for admission past its queue timeout and never started

    @property
    def is_complete(self) -> bool:
        """The choice ran to an end of its own: its text is an answer, not a fragment."""
        return self in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    draft_tokens: int = 0  # speculative tokens verified
    accepted_draft_tokens: int = 0  # of which accepted
    reasoning_tokens: int = 0  # of the completion tokens, those of the thinking (its markers included)
    prompt_seconds: float = 0.0  # from its arrival to its first token (queueing and the prompt)
    decode_seconds: float = 0.0  # from its first token to its last

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """A delta of one choice of one request. `finish_reason` is set on the choice's last delta."""

    request_id: str
    index: int  # choice index (0 .. n-1)
    text: str = ""  # the answer's text (all of it, unless a reasoning parser splits off the thinking)
    reasoning: str = ""  # the thinking's text, its markers left out
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None
    usage: Usage | None = None  # on the last delta of the request
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first delta only, when asked

    @property
    def num_bytes(self) -> int:
        """About what this delta costs held in memory and written as JSON (logprobs dominate when asked)."""
        text_bytes = len(self.text) + len(self.reasoning)
        return text_bytes + 8 * len(self.token_ids) + sum(48 + 40 * len(lp.top) for lp in self.logprobs)

    def merge(self, later: RequestOutput) -> None:
        self.text += later.text
        self.reasoning += later.reasoning
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
    proportional to its unread output, never a queue of events, and never blocks the engine. The
    stream is *backlogged* when more than `max_unread_bytes` wait unread here, or when the reader
    has been stuck writing to its client for READER_BLOCKED_SECONDS (the socket's and the server's
    buffers are full: the client is not reading). The engine then stops scheduling the request until
    the reader moves again (`on_drained` tells it), so a client that stops reading holds a bounded
    amount of memory and no share of the batch. Readable from asyncio (`async for`) or a thread (`for`).
    """

    READER_BLOCKED_SECONDS = 1.0

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None,
                 max_unread_bytes: int | None = None, on_drained: Callable[[], None] | None = None) -> None:
        self.request_id = request_id
        self.max_unread_bytes = max_unread_bytes
        self.num_unread_bytes = 0
        self._over_limit_since: float | None = None  # time.monotonic() when unread output passed the limit
        self._reader_blocked_since: float | None = None  # when the reader began a write that has not returned
        self._is_unattended = False  # nobody reads it (its connection closed; a reconnect may come)
        self._on_drained = on_drained
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
            self.num_unread_bytes += output.num_bytes
            if (self.max_unread_bytes is not None and self.num_unread_bytes > self.max_unread_bytes
                    and self._over_limit_since is None):
                self._over_limit_since = time.monotonic()
            self._finished = self._finished or is_last
            self._ready.notify()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_ready.set)  # type: ignore[union-attr]
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

    @property
    def backlogged_since(self) -> float | None:
        """Since when the reader has been holding the request back, or None."""
        if self._over_limit_since is not None:
            return self._over_limit_since
        blocked_since = self._reader_blocked_since
        if blocked_since is not None and time.monotonic() - blocked_since > self.READER_BLOCKED_SECONDS:
            return blocked_since + self.READER_BLOCKED_SECONDS
        return None

    @property
    def is_backlogged(self) -> bool:
        return self.backlogged_since is not None

    @property
    def is_unattended(self) -> bool:
        return self._is_unattended

    def set_unattended(self, is_unattended: bool) -> None:
        """No reader follows the stream (True) until one comes back (False): the engine produces nothing
        for nobody meanwhile, and a returning reader wakes it. Unlike a backlog, this is never timed out
        here: whoever keeps the stream for a reconnect decides when to abort it."""
        was_unattended, self._is_unattended = self._is_unattended, is_unattended
        if was_unattended and not is_unattended:
            self._drained_backlog()

    def reader_writes(self, is_writing: bool) -> None:
        """The reader tells when it starts and ends handing output to its client (a write that does not
        return means the client's buffers are full)."""
        if is_writing:
            self._reader_blocked_since = time.monotonic()
            return
        was_backlogged = self.is_backlogged
        self._reader_blocked_since = None
        if was_backlogged and not self.is_backlogged:
            self._drained_backlog()

    # reader side
    def _take(self) -> tuple[list[RequestOutput], bool, bool]:
        """(outputs, whether they end the stream, whether the stream was backlogged until now)."""
        outputs = [self._pending[i] for i in sorted(self._pending)]
        self._pending.clear()
        was_backlogged = self._over_limit_since is not None
        self.num_unread_bytes = 0
        self._over_limit_since = None
        return outputs, self._finished, was_backlogged

    def _drained_backlog(self) -> None:
        if self._on_drained is not None:
            self._on_drained()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async_ready is not None, "this stream was created for a thread reader"
        while not self._drained:
            await self._async_ready.wait()
            self._async_ready.clear()
            with self._lock:
                outputs, self._drained, was_backlogged = self._take()
            if was_backlogged:
                self._drained_backlog()
            for output in outputs:
                yield output

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._drained:
            with self._lock:
                while not self._pending and not self._finished:
                    self._ready.wait()
                outputs, self._drained, was_backlogged = self._take()
            if was_backlogged:
                self._drained_backlog()
            yield from outputs

    @property
    def is_finished(self) -> bool:
        return self._finished
