"""One streamed request of `treadle bench serve`: what it sends (`RequestSpec`) and what the client
measured on it (`RequestResult`: TTFT, the gaps between text-carrying chunks, output tokens, errors)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.sse import aiter_sse_data


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What every request of a run sends (the prompt aside)."""

    base_url: str
    model: str | None
    chat: bool
    max_tokens: int
    temperature: float
    ignore_eos: bool
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every body last (--extra-body)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")

    def body(self, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool = False
    error: str | None = None  # HTTP status ("429"), "stream_error", or the exception's name
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completion or chat chunk carries (choice 0; the usage chunk has no choices)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, prompt: str) -> RequestResult:
    result = RequestResult()
    started = time.perf_counter()
    last_token_at: float | None = None
    num_text_chunks = 0
    try:
        async with client.stream("POST", spec.url, json=spec.body(prompt), headers=spec.headers()) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = str(response.status_code)
                return result
            async for data in aiter_sse_data(response.aiter_bytes()):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = "stream_error"
                    return result
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.usage_reported = True
                if chunk_text(chunk):
                    now = time.perf_counter()
                    if last_token_at is None:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last_token_at)
                    last_token_at = now
                    num_text_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = type(exc).__name__
        return result
    finally:
        result.latency = time.perf_counter() - started
    if not result.usage_reported:
        result.output_tokens = num_text_chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no_output"
    return result
