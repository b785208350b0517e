"""Test-only fault injection: make engine steps fail inside a real `treadle serve`.

Off unless one of these environment variables is set (there is deliberately no command-line flag):

- `TREADLE_TEST_FAULT_EVERY_N_STEPS=N`: every N-th engine step that runs the model raises;
- `TREADLE_TEST_FAULT_SEED=S`: every step that includes a request sampled with `seed` S raises.
- `TREADLE_TEST_FAULT_FATAL_SEED=S`: the first step that includes a request with `seed` S raises an
  error the engine loop cannot contain (not an `Exception`): the engine thread ends.

A failed step ends only the requests it held, each with an error event; the reliability tests use
this to check that the server keeps serving everyone else (tests/test_reliability_faults.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from decoding.engine.engine import Engine
from decoding.engine.step import ScheduledStep

EVERY_N_STEPS = "TREADLE_TEST_FAULT_EVERY_N_STEPS"
SEED = "TREADLE_TEST_FAULT_SEED"
FATAL_SEED = "TREADLE_TEST_FAULT_FATAL_SEED"


class InjectedFault(RuntimeError):
    """The exception the hook raises, so logs say plainly that a test put it there."""


class InjectedFatalFault(BaseException):
    """What the engine loop cannot contain, as a KeyboardInterrupt or SystemExit on its thread would be."""


class StepFaults:
    def __init__(self, every_n_steps: int | None, seed: int | None, fatal_seed: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.seed = seed
        self.fatal_seed = fatal_seed
        self.num_steps = 0
        self.num_faults = 0

    def __call__(self, scheduled: ScheduledStep) -> None:
        self.num_steps += 1
        if self.every_n_steps is not None and self.num_steps % self.every_n_steps == 0:
            self._fail(f"step {self.num_steps}")
        if self.seed is not None and any(c.seq.params.seed == self.seed for c in scheduled.chunks):
            self._fail(f"a request with seed {self.seed}")
        if self.fatal_seed is not None and any(c.seq.params.seed == self.fatal_seed for c in scheduled.chunks):
            self.num_faults += 1
            raise InjectedFatalFault(f"fatal fault injected by {FATAL_SEED} at a request with seed {self.fatal_seed}")

    def _fail(self, what: str) -> None:
        self.num_faults += 1
        raise InjectedFault(f"fault injected by {EVERY_N_STEPS}/{SEED} at {what}")

    def describe(self) -> str:
        parts = [f"every {self.every_n_steps} steps"] if self.every_n_steps else []
        parts += [f"on requests with seed {self.seed}"] if self.seed is not None else []
        parts += [f"fatally on a request with seed {self.fatal_seed}"] if self.fatal_seed is not None else []
        return " and ".join(parts)


def install_from_env(engine: Engine, environ: Mapping[str, str] = os.environ) -> StepFaults | None:
    """Install the hook described by the environment; None (and nothing installed) when it says nothing."""
    every = environ.get(EVERY_N_STEPS, "").strip()
    seed = environ.get(SEED, "").strip()
    fatal_seed = environ.get(FATAL_SEED, "").strip()
    if not every and not seed and not fatal_seed:
        return None
    every_n_steps = int(every) if every else None
    if every_n_steps is not None and every_n_steps < 1:
        raise ValueError(f"{EVERY_N_STEPS} must be at least 1, got {every_n_steps}")
    faults = StepFaults(every_n_steps, int(seed) if seed else None, int(fatal_seed) if fatal_seed else None)
    engine.fault_hook = faults
    return faults
