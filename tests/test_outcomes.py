"""The outcome table: every way a choice ends reads one way in every API."""

import pytest

from app.outcomes import OUTCOMES, api_error, error_event, finish_reason_of, first_failure, is_failure
from decoding.engine.outputs import FinishReason, RequestOutput


def ended(reason: FinishReason, error: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", index, finish_reason=reason, error=error)


def test_every_finish_reason_has_an_outcome():
    assert set(OUTCOMES) == set(FinishReason)


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS])
def test_a_choice_that_ran_to_its_end_is_an_answer(reason):
    assert not is_failure(ended(reason)) and first_failure([ended(reason)]) is None
    assert OUTCOMES[reason].finish_reason == reason.value


def test_a_client_abort_is_never_reported_as_shutdown_even_with_a_message():
    """A slow reader's abort carries a message: it is still the client's, finish_reason "abort"."""
    slow_reader = ended(FinishReason.ABORT_CLIENT, "the client read nothing for 60 s")
    assert not is_failure(slow_reader) and OUTCOMES[FinishReason.ABORT_CLIENT].finish_reason == "abort"
    assert first_failure([ended(FinishReason.STOP), slow_reader]) is slow_reader  # not an answer either
    assert api_error(slow_reader).status == 499


@pytest.mark.parametrize(("reason", "status", "code", "retry"), [
    (FinishReason.ABORT_SHUTDOWN, 503, "shutting_down", True),
    (FinishReason.TIMEOUT, 503, "queue_timeout", True),
    (FinishReason.ERROR, 500, None, False),
])  # fmt: skip
def test_a_failure_is_the_same_error_streamed_or_whole(reason, status, code, retry):
    output = ended(reason, "what the engine said" if reason != FinishReason.ABORT_SHUTDOWN else None)
    assert is_failure(output)
    error = api_error(output)
    event = error_event(output)["error"]
    assert (error.status, error.code, "Retry-After" in error.headers) == (status, code, retry)
    assert event["code"] == code and event["message"] == error.message and error.message


def test_the_wire_finish_reason_comes_from_the_table():
    assert finish_reason_of(ended(FinishReason.ABORT_CLIENT)) == "abort"  # vLLM's value, not the engine's name
    assert finish_reason_of(ended(FinishReason.STOP), has_calls=True) == "tool_calls"
    assert finish_reason_of(ended(FinishReason.LENGTH), has_calls=True) == "length"  # a cut call is no call
    assert finish_reason_of(RequestOutput("r", 0)) is None
