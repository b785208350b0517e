"""What the engine reports while it runs: hooks for observers (metrics, logs) and running totals."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from .outputs import FinishReason
from .sequence import Request
from .step import ScheduledStep


class EngineObserver(Protocol):
    """Called on the engine thread; implementations must not block (metrics, logs). An observer
    defines the hooks it wants; the engine skips the others."""

    def on_step(self, seconds: float, kernel_seconds: float, num_tokens: int, num_seqs: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_request_finished(self, request: Request, finish_reason: FinishReason) -> None: ...
    def on_preemption(self) -> None: ...
    def on_slow_reader_abort(self) -> None: ...
    def on_queue_timeout(self) -> None: ...
    def on_step_scheduled(self, scheduled: ScheduledStep, seconds: float, kernel_seconds: float) -> None: ...


log = logging.getLogger(__name__)


def notify(observers: list[EngineObserver], method: str, *args: Any) -> None:
    """Call `method` on every observer that defines it; an observer's failure is logged, never raised."""
    for observer in observers:
        hook = getattr(observer, method, None)
        if hook is None:
            continue
        try:
            hook(*args)
        except Exception:  # an observer must never take the engine down
            log.exception("engine observer %s.%s failed", type(observer).__name__, method)


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    step_seconds: float = 0.0
    kernel_seconds: float = 0.0
    num_slow_reader_aborts: int = 0
    num_draft_tokens: int = 0  # speculative tokens verified in model steps
    num_accepted_draft_tokens: int = 0
