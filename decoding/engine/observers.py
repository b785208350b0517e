"""What the engine reports while it runs: hooks for observers (metrics, logs) and running totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .scheduler import SchedulerOutput
from .sequence import Request


class EngineObserver(Protocol):
    """Called on the engine thread; implementations must not block (metrics, logs). An observer
    defines the hooks it wants; the engine skips the others."""

    def on_step(self, seconds: float, kernel_seconds: float, num_tokens: int, num_seqs: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_request_finished(self, request: Request, finish_reason: str) -> None: ...
    def on_preemption(self) -> None: ...
    def on_slow_reader_abort(self) -> None: ...
    def on_queue_timeout(self) -> None: ...
    def on_step_scheduled(self, scheduled: SchedulerOutput, seconds: float, kernel_seconds: float) -> None: ...


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
