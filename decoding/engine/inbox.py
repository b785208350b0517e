"""The engine's inbox: commands from any thread to the engine thread, and the condition it parks on.

Every field here is guarded by one condition. Other threads only append commands (and are refused
once the engine stops, failed or holds `max_queue` unfinished requests); the engine thread takes
them between steps, so it alone touches engine state.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import EngineFailed, EngineShuttingDown, QueueFull

Command = tuple[str, Any]


class Inbox:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.wakeup = threading.Condition()
        self.commands: deque[Command] = deque()
        self.num_unfinished = 0  # requests submitted and not yet finished
        self.stopping = False
        self.is_idle = False  # the last step scheduled nothing (every running request's reader lags)
        self.failure: str | None = None  # why the engine thread ended, if it did on an error

    def put(self, command: str, payload: Any, new_request: bool = False) -> None:
        """Queue a command; a `new_request` counts as unfinished until `request_done`, and is refused
        (QueueFull, EngineShuttingDown, EngineFailed) where the engine cannot take one."""
        with self.wakeup:
            if new_request:
                self._check_accepting()
                self.num_unfinished += 1
            self.commands.append((command, payload))
            self.wakeup.notify()

    def _check_accepting(self) -> None:
        if self.failure is not None:
            raise EngineFailed(f"the engine failed and serves nothing more: {self.failure}")
        if self.stopping:
            raise EngineShuttingDown("the engine is shutting down")
        if self.num_unfinished >= self.max_queue:
            raise QueueFull(f"{self.num_unfinished} requests are running or waiting (max_queue)")

    def take(self) -> Command | None:
        with self.wakeup:
            return self.commands.popleft() if self.commands else None

    def take_all(self) -> list[Command]:
        with self.wakeup:
            pending, self.commands = list(self.commands), deque()
        return pending

    def request_done(self) -> None:
        with self.wakeup:
            self.num_unfinished -= 1

    def wake(self) -> None:
        """Something became schedulable (a paused request's reader caught up)."""
        with self.wakeup:
            self.is_idle = False
            self.wakeup.notify()

    def mark_idle(self) -> None:
        """The engine is about to schedule: idle until it schedules something (a `wake` meanwhile clears it)."""
        with self.wakeup:
            self.is_idle = True

    def stop(self, failure: str | None = None) -> None:
        """Refuse new requests from now on (the inbox then only shrinks); wake the engine thread."""
        with self.wakeup:
            self.stopping = True
            if failure is not None:
                self.failure = failure
            self.wakeup.notify()

    def wait_for_work(self, has_work: Callable[[], bool], recheck_seconds: float) -> bool:
        """Park until there is something to do; False once the engine is stopping. While every running
        request is paused for its reader (`is_idle`), return every `recheck_seconds` so the engine can
        end those paused past their timeout."""
        with self.wakeup:
            while not self.commands and not self.stopping:
                if not has_work():
                    self.wakeup.wait()
                elif not self.is_idle:
                    break
                elif not self.wakeup.wait(recheck_seconds):
                    break
            return not self.stopping
