"""The clients of `treadle bench soak`: what they send (valid requests with random settings, some left
mid-stream, some malformed), how they read the answers, and what they count in `SoakStats`."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.soak_checks import check_sse_events, check_whole_response
from bench.sse import SSEDecoder

_WORDS = (
    "loom", "wheel", "thread", "yarn", "weave", "cloth", "wool", "spin", "mill", "town", "road", "river",
    "hill", "tree", "stone", "light", "sound", "word", "line", "page", "the", "of", "and", "to", "in",
    "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it", "an", "be", "this", "are",
    "or", "one", "all", "were", "they", "had", "there", "not", "but", "have", "been", "more", "when",
    "who", "will", "would", "their", "can", "into", "time",
)
_SYSTEM = "You are a terse assistant."
_STOPS = (["\n\n"], [".", "!"], ["the end"])


@dataclass(slots=True)
class SoakConfig:
    base_url: str = "http://127.0.0.1:8000"
    duration: float = 60.0
    clients: int = 16
    disconnect_rate: float = 0.2
    malformed_rate: float = 0.02
    max_prompt_words: int = 300
    max_tokens: int = 128
    non_streamed_rate: float = 0.1
    seed: int = 0
    api_key: str | None = None
    health_interval: float = 0.2
    metrics_interval: float = 2.0
    max_rss_growth_mib: float = 64.0
    max_health_p99_ms: float = 1000.0
    finish_timeout: float = 300.0  # for the requests still running when the time is up


@dataclass(slots=True)
class SoakStats:
    num_requests: int = 0
    num_streams_completed: int = 0  # read to the end (streamed) or answered in full (not streamed)
    num_disconnects: int = 0  # left on purpose before the end
    num_malformed_sent: int = 0
    num_malformed_refused: int = 0  # answered 4xx, as they must be
    num_rejected: int = 0  # 429: the bounded queue at work, not a failure
    num_5xx: int = 0
    num_error_events: int = 0
    num_transport_errors: int = 0
    num_completion_tokens: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # ill-formed streams and unexpected answers
    health_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)  # request sent → first token's event (streams)
    num_health_failures: int = 0
    samples: list[dict[str, float]] = field(default_factory=list)  # /metrics over time

    def problem(self, text: str) -> None:
        if len(self.problems) < 1000:
            self.problems.append(text)


# ---- malformed requests: each must be answered 4xx --------------------------------------------------

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_OK_MESSAGES = [{"role": "user", "content": "hi"}]
MALFORMED: list[tuple[str, str, bytes]] = [
    ("truncated JSON", _CHAT, b'{"messages": [{"role": "user", "content": "hi"'),
    ("invalid UTF-8", _COMPLETIONS, b'{"prompt": "\xc3\x28\xff"}'),
    ("NaN temperature", _COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}'),
    ("max_tokens negative", _COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": -5}).encode()),
    ("max_tokens huge", _CHAT, json.dumps({"messages": _OK_MESSAGES, "max_tokens": 10**12}).encode()),
    ("messages a number", _CHAT, json.dumps({"messages": 7}).encode()),
    ("unknown role", _CHAT, json.dumps({"messages": [{"role": "god", "content": "x"}]}).encode()),
    ("deep nesting", _COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("stop list of 5000", _CHAT, json.dumps({"messages": _OK_MESSAGES, "stop": ["x"] * 5000}).encode()),
    ("prompt ids out of vocab", _COMPLETIONS, json.dumps({"prompt": [2**40, -1]}).encode()),
    ("echo of ids past 32 bits", _COMPLETIONS, json.dumps({"prompt": [2**32], "echo": True}).encode()),
    ("a JSON array", _CHAT, b"[1, 2, 3]"),
    ("empty body", _COMPLETIONS, b""),
]


# ---- the clients ----------------------------------------------------------------------------------


def random_body(rng: random.Random, cfg: SoakConfig) -> tuple[str, str, dict[str, Any]]:
    """(kind, path, body) of a valid generation request."""
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, cfg.max_tokens), "n": rng.choice((1, 1, 1, 2))}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**32))
    if rng.random() < 0.2:
        body["stop"] = rng.choice(_STOPS)
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": words}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": _SYSTEM})
        return "chat", _CHAT, {**body, "messages": messages}
    return "completion", _COMPLETIONS, {**body, "prompt": words}


class SoakClient:
    def __init__(self, cfg: SoakConfig, http: httpx.AsyncClient, stats: SoakStats) -> None:
        self.cfg = cfg
        self.http = http
        self.stats = stats

    async def run(self, index: int, stop_at: float) -> None:
        rng = random.Random(self.cfg.seed * 1_000_003 + index)
        while time.monotonic() < stop_at:
            try:
                if rng.random() < self.cfg.malformed_rate:
                    await self.malformed(rng)
                else:
                    await self.generate(rng)
            except httpx.HTTPError as exc:
                self.stats.num_transport_errors += 1
                self.stats.problem(f"transport error: {type(exc).__name__}: {exc}")

    def _status(self, response: httpx.Response, what: str) -> bool:
        """Count the status; True if it is 200."""
        stats = self.stats
        stats.statuses[response.status_code] += 1
        if response.status_code >= 500:
            stats.num_5xx += 1
            stats.problem(f"{response.status_code} for {what}: {response.text[:200]}")
        elif response.status_code == 429:
            stats.num_rejected += 1
        elif response.status_code != 200:
            stats.problem(f"{response.status_code} for a valid {what}: {response.text[:200]}")
        return response.status_code == 200

    async def malformed(self, rng: random.Random) -> None:
        name, path, raw = rng.choice(MALFORMED)
        self.stats.num_malformed_sent += 1
        response = await self.http.post(path, content=raw, headers={"Content-Type": "application/json"})
        self.stats.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.stats.num_5xx += 1
            self.stats.problem(f"{response.status_code} for malformed request {name!r}: {response.text[:200]}")
        elif 400 <= response.status_code < 500:
            self.stats.num_malformed_refused += 1
        else:
            self.stats.problem(f"malformed request {name!r} answered {response.status_code}")

    async def generate(self, rng: random.Random) -> None:
        kind, path, body = random_body(rng, self.cfg)
        leaves = rng.random() < self.cfg.disconnect_rate
        self.stats.num_requests += 1
        if rng.random() < self.cfg.non_streamed_rate:
            await self.whole(kind, path, body, leave_after=rng.uniform(0, 3) if leaves else None)
        else:
            include_usage = rng.random() < 0.3
            body.update(stream=True, stream_options={"include_usage": True} if include_usage else None)
            leave_after = rng.randint(0, body["max_tokens"]) if leaves else None
            await self.stream(kind, path, body, include_usage, leave_after)

    async def whole(self, kind: str, path: str, body: dict[str, Any], leave_after: float | None) -> None:
        try:
            response = await asyncio.wait_for(self.http.post(path, json=body), leave_after)
        except TimeoutError:
            self.stats.num_disconnects += 1  # cancelled: httpx closes the connection mid-request
            return
        if not self._status(response, f"{kind} request"):
            return
        problems = check_whole_response(response.json(), kind, body["n"])
        self._finished(problems, response.json().get("usage"))

    async def stream(self, kind: str, path: str, body: dict[str, Any], include_usage: bool,
                     leave_after: int | None) -> None:
        sent = time.perf_counter()
        first_token_event = 2 if kind == "chat" else 1  # a chat stream opens with the role chunk
        async with self.http.stream("POST", path, json=body) as response:
            if not self._status(response, f"{kind} stream"):
                await response.aread()
                return
            if leave_after == 0:  # gone before the first event: perhaps while the request still waits
                self.stats.num_disconnects += 1
                return
            events: list[str] = []
            decoder = SSEDecoder()
            async for chunk in response.aiter_bytes():
                for data in decoder.feed(chunk):
                    events.append(data)
                    if len(events) == first_token_event:
                        self.stats.ttft_ms.append((time.perf_counter() - sent) * 1000)
                    if leave_after is not None and len(events) >= leave_after:
                        self.stats.num_disconnects += 1  # leaving the block closes the connection
                        return
                while decoder.other_lines:  # treadle sends data and comments only
                    self.stats.problem(f"not an SSE line: {decoder.other_lines.pop(0)[:80]!r}")
        usage = None
        if include_usage and len(events) > 1 and events[-2].startswith("{"):
            usage = json.loads(events[-2]).get("usage")
        self._finished(check_sse_events(events, kind, body["n"], include_usage), usage)

    def _finished(self, problems: list[str], usage: dict[str, int] | None) -> None:
        stats = self.stats
        stats.num_streams_completed += 1
        stats.num_error_events += sum(p.startswith("error event") for p in problems)
        for p in problems:
            stats.problem(p)
        if usage:
            stats.num_completion_tokens += usage.get("completion_tokens", 0)
