"""What a well-formed answer of an OpenAI-compatible server is: the checks `treadle bench soak` runs on
every stream and whole answer it reads to the end, shared with the reliability tests."""

from __future__ import annotations

import json
from typing import Any

FINISH_REASONS = ("stop", "length")


def check_sse_events(events: list[str], kind: str, n: int, include_usage: bool) -> list[str]:
    """Problems with one SSE stream's `data:` payloads, in order ([] if well formed).

    `kind` is "chat" or "completion". Error events are reported as problems too.
    """
    problems: list[str] = []
    if not events or events[-1] != "[DONE]":
        return [f"the stream does not end with [DONE] (last: {events[-1][:80] if events else None!r})"]
    finished: dict[int, str] = {}
    seen_role: set[int] = set()
    expected_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
    ids = set()
    chunks = events[:-1]
    for position, payload in enumerate(chunks):
        if payload == "[DONE]":
            return [*problems, "[DONE] before the end of the stream"]
        try:
            chunk = json.loads(payload)
        except ValueError:
            return [*problems, f"not JSON: {payload[:80]!r}"]
        if "error" in chunk:
            problems.append(f"error event: {chunk['error'].get('message', chunk['error'])}")
            continue
        if chunk.get("object") != expected_object:
            problems.append(f"object {chunk.get('object')!r}, expected {expected_object!r}")
        ids.add(chunk.get("id"))
        if include_usage != ("usage" in chunk):
            problems.append("usage field present without include_usage" if "usage" in chunk
                            else "usage field missing with include_usage")
        if not chunk["choices"]:
            is_usage_chunk = include_usage and chunk.get("usage") is not None and position == len(chunks) - 1
            if not is_usage_chunk:
                problems.append("a chunk with no choices that is not the final usage chunk")
            continue
        for choice in chunk["choices"]:
            index = choice["index"]
            if not 0 <= index < n:
                problems.append(f"choice index {index} with n={n}")
            if index in finished:
                problems.append(f"choice {index} continues after its finish_reason")
            reason = choice.get("finish_reason")
            if reason is not None:
                if reason not in FINISH_REASONS:
                    problems.append(f"finish_reason {reason!r}")
                finished[index] = reason
            if kind == "chat":
                delta = choice.get("delta", {})
                if index not in seen_role and delta.get("role") != "assistant":
                    problems.append(f"choice {index} starts without role assistant")
                seen_role.add(index)
                if reason is not None and delta:
                    problems.append("the finish chunk carries content")
    if len(ids) > 1:
        problems.append(f"{len(ids)} different ids in one stream")
    missing = set(range(n)) - set(finished)
    if missing and not any(p.startswith("error event") for p in problems):
        problems.append(f"choices {sorted(missing)} have no finish_reason")
    if include_usage and (not chunks or json.loads(chunks[-1]).get("choices") != []):
        problems.append("include_usage but no final usage chunk")
    return problems


def check_whole_response(body: dict[str, Any], kind: str, n: int) -> list[str]:
    expected_object = "chat.completion" if kind == "chat" else "text_completion"
    problems = []
    if body.get("object") != expected_object:
        problems.append(f"object {body.get('object')!r}, expected {expected_object!r}")
    choices = body.get("choices", [])
    if sorted(c.get("index") for c in choices) != list(range(n)):
        problems.append(f"choices {[c.get('index') for c in choices]} with n={n}")
    problems += [f"finish_reason {c.get('finish_reason')!r}" for c in choices if c.get("finish_reason")
                 not in FINISH_REASONS]
    if not isinstance(body.get("usage"), dict):
        problems.append("no usage")
    return problems
