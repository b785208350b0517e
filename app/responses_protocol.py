"""OpenAI's Responses API answer: the response object and the typed events that build it.

`ResponseState` is the response object as it stands (what `GET /v1/responses/{id}` returns, also
while it runs), and `ResponsesFormatter` turns engine outputs into the stream's events — created,
in_progress, an output item per message or function call with its parts and deltas, then completed,
incomplete or failed — updating the state as it goes, so the two never disagree. The request is in
app/responses_schemas.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

from decoding.engine.outputs import FinishReason, RequestOutput, Usage

from .outcomes import failure_message, is_failure, outcome_of
from .protocol import Chunk
from .responses_schemas import ResponsesRequest, new_id
from .tools import ToolSyntax


def usage_of(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}


class ResponseState:
    """The response object as it stands; the formatter updates it as events are made."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str) -> None:
        self.id = response_id
        self.body = body
        self.model = model
        self.created_at = int(time.time())
        self.status = "queued" if body.background else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.failure: FinishReason | None = None  # why it failed, where it did
        self.incomplete_details: dict[str, Any] | None = None
        self.finished_at: float | None = None  # time.monotonic() when its last event was made
        self.history: list[dict[str, Any]] = []  # the previous response's conversation, if it continues one
        self.conversation: list[dict[str, Any]] = []  # history, input and answer, for a later previous_response_id

    @property
    def is_finished(self) -> bool:
        return self.finished_at is not None

    def as_dict(self) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": body.background, "error": self.error, "incomplete_details": self.incomplete_details,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": [dict(item) for item in self.output], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                            else body.tool_choice.model_dump()) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
            "usage": self.usage, "metadata": body.metadata or {}, "user": body.user,
        }



class ResponsesFormatter:
    """Engine outputs → the Responses API's stream events, each with its `sequence_number`."""

    def __init__(self, state: ResponseState, tool_syntax: ToolSyntax | None) -> None:
        self.state = state
        self.tool_stream = tool_syntax.stream() if tool_syntax is not None else None
        self.num_events = 0
        self._open: dict[str, Any] | None = None  # the output item being written
        self._text = ""  # the open message's text so far

    def _event(self, kind: str, **fields: Any) -> Chunk:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def first_chunks(self) -> list[Chunk]:
        self.state.status = "in_progress"
        snapshot = self.state.as_dict()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunks(self, output: RequestOutput) -> list[Chunk]:
        events: list[Chunk] = self._text_delta(output.reasoning, "reasoning") if output.reasoning else []
        pieces: list[str | dict[str, Any]] = [output.text] if output.text else []
        if self.tool_stream is not None:
            pieces = self.tool_stream.feed(output.text)
            if output.finish_reason is not None:
                pieces += self.tool_stream.finish()
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text_delta(piece)
            elif "id" in piece:  # a call begins
                events += self._close_item()
                events += self._open_item({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                           "arguments": "", "call_id": piece["id"], "name": piece["function"]["name"]})
                if piece["function"]["arguments"]:
                    events += self._arguments_delta(piece["function"]["arguments"])
            else:
                events += self._arguments_delta(piece["function"]["arguments"])
        if output.finish_reason is not None:
            events += self._close_item()
            events += self._finish(output)
        return events

    def last_chunks(self) -> list[Chunk]:
        return []

    def _open_item(self, item: dict[str, Any]) -> list[Chunk]:
        self._open = item
        self.state.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.state.output) - 1, item=dict(item))]

    def _text_delta(self, text: str, kind: str = "message") -> list[Chunk]:
        """Text of the answer (`message`) or of the thinking (`reasoning`), in an item of that kind."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_item()
            if kind == "message":
                events += self._open_item({"id": new_id("msg"), "type": "message", "status": "in_progress",
                                           "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                events += self._open_item({"id": new_id("rs"), "type": "reasoning", "status": "in_progress",
                                           "summary": [], "content": []})
                part = {"type": "reasoning_text", "text": ""}
            self._open["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(), part=dict(part)))
        self._text += text
        self._open["content"][0]["text"] = self._text
        if kind == "message":
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **self._where(), delta=text))
        return events

    def _arguments_delta(self, fragment: str) -> list[Chunk]:
        assert self._open is not None
        self._open["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                            output_index=len(self.state.output) - 1, delta=fragment)]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.state.output) - 1, "content_index": 0}

    def _close_item(self) -> list[Chunk]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = len(self.state.output) - 1
        if item["type"] in ("message", "reasoning"):
            part, text = item["content"][0], self._text
            self._text = ""
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = (self._event("response.output_text.done", **where, text=text, logprobs=[])
                    if item["type"] == "message" else self._event("response.reasoning_text.done", **where, text=text))
            events = [done, self._event("response.content_part.done", **where, part=dict(part))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=json.loads(json.dumps(item)))]

    def _finish(self, output: RequestOutput) -> list[Chunk]:
        state = self.state
        state.finished_at = time.monotonic()
        state.usage = usage_of(output.usage)
        outcome = outcome_of(output)
        state.status = outcome.responses_status
        if outcome.finish_reason is not None:
            if output.finish_reason == FinishReason.LENGTH:
                state.incomplete_details = {"reason": "max_output_tokens"}
            state.conversation = self._conversation()
            kind = "response.incomplete" if state.status == "incomplete" else "response.completed"
            return [self._event(kind, response=state.as_dict())]
        if is_failure(output):
            state.failure = FinishReason(output.finish_reason)
            state.error = {"code": outcome.code, "message": failure_message(output)}
        return [self._event("response.failed", response=state.as_dict())]  # failed, or cancelled

    def _conversation(self) -> list[dict[str, Any]]:
        """What a later request with previous_response_id continues: this one's input and its answer."""
        state = self.state
        history = [*state.history, *state.body.input_messages()]
        answer: dict[str, Any] | None = None
        for item in state.output:
            if answer is None:
                answer = {"role": "assistant", "content": None}
                history.append(answer)
            if item["type"] == "reasoning":
                answer["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                answer["content"] = (answer["content"] or "") + item["content"][0]["text"]
            else:
                answer.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return history
