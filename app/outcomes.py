"""How the end of a choice reads in every API: one table from the engine's `FinishReason`.

A choice that ran to an end of its own (stop, length, tool calls) is a finish reason in the answer.
The others are not answers: a client that cancelled or left gets `abort` where anyone still reads
(vLLM's value), and a choice the server could not finish — shutdown, a fault, a queue timeout — is an
error with a status and a code: the whole response for a plain request, an error event in a stream,
a failed response in the Responses API. Routes look outcomes up here; none spells them itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decoding.engine.outputs import FinishReason, RequestOutput

from .errors import RETRY_AFTER_SECONDS, APIError, error_body


@dataclass(frozen=True, slots=True)
class Outcome:
    finish_reason: str | None  # chat and completions; None: the choice ends in an error instead
    responses_status: str  # the Responses API's response status
    status: int = 200  # HTTP status of a plain (not streamed) answer that ends so
    code: str | None = None  # the error's code
    message: str = ""  # the error's message when the engine gave none
    retry: bool = False  # worth retrying as it is: answered with Retry-After
    anthropic_stop_reason: str | None = None  # the Messages API's stop_reason (a stop string: stop_sequence)
    ollama_done_reason: str | None = None  # Ollama's done_reason


OUTCOMES: dict[FinishReason, Outcome] = {
    FinishReason.STOP: Outcome("stop", "completed", anthropic_stop_reason="end_turn", ollama_done_reason="stop"),
    FinishReason.LENGTH: Outcome("length", "incomplete", anthropic_stop_reason="max_tokens",
                                 ollama_done_reason="length"),
    FinishReason.TOOL_CALLS: Outcome("tool_calls", "completed", anthropic_stop_reason="tool_use",
                                     ollama_done_reason="stop"),
    FinishReason.ABORT_CLIENT: Outcome("abort", "cancelled", 499, "cancelled", "the request was cancelled"),
    FinishReason.ABORT_SHUTDOWN: Outcome(None, "failed", 503, "shutting_down", "the server is shutting down: this "
                                         "generation was ended before it finished", retry=True),  # fmt: skip
    FinishReason.ERROR: Outcome(None, "failed", 500, "server_error", "generation failed"),
    FinishReason.TIMEOUT: Outcome(None, "failed", 503, "queue_timeout", "the request waited in the queue past its "
                                  "timeout", retry=True),  # fmt: skip
}


def outcome_of(output: RequestOutput) -> Outcome:
    assert output.finish_reason is not None, "only a choice's last output has an outcome"
    return OUTCOMES[FinishReason(output.finish_reason)]


def finish_reason_of(output: RequestOutput, has_calls: bool = False) -> str | None:
    """The wire's finish_reason for a choice's delta (None until its last); `has_calls`: the answer held
    tool calls, so a natural stop reads `tool_calls`."""
    if output.finish_reason is None:
        return None
    reason = FinishReason(output.finish_reason)
    if has_calls and reason == FinishReason.STOP:
        reason = FinishReason.TOOL_CALLS
    return OUTCOMES[reason].finish_reason


def is_failure(output: RequestOutput) -> bool:
    """The choice ended without an answer of its own and not by its client's choice: an error to report."""
    return output.finish_reason is not None and outcome_of(output).finish_reason is None


def failure_message(output: RequestOutput) -> str:
    return output.error or outcome_of(output).message


def api_error(output: RequestOutput) -> APIError:
    """A failed choice as the error that answers a plain request."""
    return error_for(FinishReason(output.finish_reason), failure_message(output))


def error_for(reason: FinishReason, message: str) -> APIError:
    outcome = OUTCOMES[reason]
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if outcome.retry else None
    return APIError(outcome.status, message, code=None if outcome.status == 500 else outcome.code, headers=headers)


def error_event(output: RequestOutput) -> dict[str, Any]:
    """A failed choice as the error event that ends a stream."""
    outcome = outcome_of(output)
    code = None if outcome.status == 500 else outcome.code
    return error_body(outcome.status, failure_message(output), code=code)


def first_failure(outputs: list[RequestOutput]) -> RequestOutput | None:
    """The first choice that failed or was aborted: a plain request answers with it instead of choices."""
    return next((o for o in outputs if o.finish_reason is not None and not FinishReason(o.finish_reason).is_complete),
                None)
