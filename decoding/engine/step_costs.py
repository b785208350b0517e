"""What a step costs, and how many prompt tokens a step may take while streams decode.

`StepCostModel` fits a step's seconds to its decode rows and prompt tokens; `PrefillBudget` spends one
step's prompt tokens under the bounds the scheduler derives from it (see decoding/engine/scheduler.py
for the policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LONG_PREFILL_TOKENS = 512
# While streams decode, prompts may always take this much of a step, whatever the stretch bound allows:
# a few streams make a short decode step, whose bound would admit a handful of prompt tokens a step, and
# a queue would drain slower than requests arrive. It costs those few streams a gap of at most this
# much more.
PREFILL_FLOOR_SECONDS = 0.02


class StepCostModel:
    """What a step costs: seconds ≈ base + per_row × decode rows + per_token × prompt tokens.

    One linear model over every step, fitted by exponentially weighted least squares (a CPU step is
    compute-bound: its time grows with the rows it computes), so that a churning batch of 10 to 32
    sequences is priced at its size and a step's prompt tokens are told apart from its decodes. Steps
    that mix both teach the decode rows' price too: when a wave of prompts arrives, every step for a
    while carries a prefill, and a decode line learned only from decode-only steps would price the
    wave's decodes at the batch of the last decode-only steps. Where the recent steps do
    not tell two coefficients apart (a steady batch, no prompts), a light ridge keeps them where they
    were. The latest chunk's cost per token is kept as well: a long prompt's tokens grow dearer as it
    goes on (attention reads its whole context).
    """

    MIN_PREFILL_CHUNK = 4  # tokens: a long prompt always makes progress
    # Steps whose prompt tokens are fewer than this teach nothing: a step's jitter divided by a few
    # tokens makes them look several times dearer, and smaller chunks would follow.
    MIN_LEARNING_CHUNK = 16
    # Chunks are planned to this share of the allowed extra time: a decode step's own time varies by
    # ±20% on a busy machine and grows as the streams' contexts do: planned to the full allowance, the
    # largest gaps pass the bound (docs/performance.md has the measurements).
    PLANNING_MARGIN = 0.8
    _DECAY = 0.97  # per step: the fit follows the last ~30 steps
    _RIDGE = 1e-3  # pull of the previous slopes, relative to what the recent steps say about each

    def __init__(self, max_itl_stretch: float) -> None:
        self.max_itl_stretch = max_itl_stretch
        self.base_seconds = 0.0
        self.seconds_per_row: float | None = None  # a decode row's cost (drafts included)
        self.seconds_per_token: float | None = None  # a prompt token's cost in a step
        self.latest_seconds_per_token: float | None = None  # a growing prompt costs more per token each chunk
        self._weight = 0.0
        self._moments = np.zeros((3, 3))  # decayed Σ x xᵀ over x = (1, rows, prompt tokens)
        self._targets = np.zeros(3)  # decayed Σ x · seconds

    def assume(self, decode_step_seconds: float, num_decodes: int, seconds_per_token: float) -> None:
        """Start from known costs (tests; a caller that measured them elsewhere): a decode-only step of
        `num_decodes` rows takes `decode_step_seconds`, all of it per row."""
        self._weight = 1.0
        self.base_seconds, self.seconds_per_row = 0.0, decode_step_seconds / max(1, num_decodes)
        self.seconds_per_token = seconds_per_token

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        if 0 < num_prefill_tokens < self.MIN_LEARNING_CHUNK or num_decode_tokens + num_prefill_tokens == 0:
            return
        if num_prefill_tokens and num_decode_tokens and self.seconds_per_row is not None:
            extra = (seconds - self.decode_step_seconds(num_decode_tokens)) / num_prefill_tokens
            if extra > 0:
                self.latest_seconds_per_token = extra
        x = np.array([1.0, num_decode_tokens, num_prefill_tokens])
        self._weight = self._DECAY * self._weight + 1.0
        self._moments = self._DECAY * self._moments + np.outer(x, x)
        self._targets = self._DECAY * self._targets + x * seconds
        self._refit(num_decode_tokens, num_prefill_tokens, seconds)

    def _refit(self, rows: int, tokens: int, seconds: float) -> None:
        # slopes never seen (no decode row, or no prompt token, yet) start at this step's cost per row
        first_guess = seconds / (rows + tokens)
        previous = np.array([self.base_seconds, self.seconds_per_row or first_guess,
                             self.seconds_per_token or first_guess])
        seen = np.diag(self._moments) > 0
        ridge = self._RIDGE * (np.diag(self._moments) + 1.0) * np.array([0.0, 1.0, 1.0])
        ridge[0] = 1e-12  # the base: kept solvable when every step so far had the same rows
        active = np.flatnonzero(seen)
        system = self._moments[np.ix_(active, active)] + np.diag(ridge[active])
        rhs = self._targets[active] + ridge[active] * previous[active]
        try:
            solution = np.linalg.solve(system, rhs)
        except np.linalg.LinAlgError:
            return
        fitted = previous.copy()
        fitted[active] = solution
        if fitted[1] <= 0 or fitted[2] <= 0:  # a fit of collinear steps gone astray: keep the last whole one
            return  # (full-budget steps all have rows + prompt tokens = the budget)
        self.base_seconds = float(fitted[0])
        if seen[1]:
            self.seconds_per_row = float(fitted[1])
        if seen[2]:
            self.seconds_per_token = float(fitted[2])

    def decode_step_seconds(self, num_decodes: int) -> float:
        """A decode-only step of `num_decodes` sequences, as the fit prices it."""
        per_row = self.seconds_per_row if self.seconds_per_row is not None else self.seconds_per_token or 0.0
        return max(self.base_seconds + per_row * num_decodes, 1e-4)

    def prefill_budget_while_decoding(self, budget: int, num_decodes: int, stretch: float | None = None) -> int:
        """Prompt tokens that keep a step with `num_decodes` decodes within `stretch` (default: the bound)
        times a decode-only step."""
        if not self._weight or self.seconds_per_token is None:
            return min(budget, 16 * self.MIN_PREFILL_CHUNK)  # until measured: a modest chunk
        # The cost of a prefill token grows with its position (attention reads its whole context), so
        # the latest chunk's cost, when higher, wins over the average: a long prompt's chunks shrink as it goes on.
        per_token = max(self.seconds_per_token, self.latest_seconds_per_token or 0.0)
        stretch = self.max_itl_stretch if stretch is None else stretch
        allowed = self.PLANNING_MARGIN * (stretch - 1.0) * self.decode_step_seconds(num_decodes) / per_token
        return max(self.MIN_PREFILL_CHUNK, min(budget, int(allowed + 1e-6)))  # 15.99999 tokens are 16

    def prefill_floor_tokens(self, budget: int) -> int:
        """The prompt tokens PREFILL_FLOOR_SECONDS buys (at the average cost), within `budget`."""
        if self.seconds_per_token is None:
            return min(budget, 16 * self.MIN_PREFILL_CHUNK)
        # never below a learning chunk: chunks too small to price would keep the estimate where it is
        return min(budget, max(self.MIN_LEARNING_CHUNK, int(PREFILL_FLOOR_SECONDS / self.seconds_per_token + 1e-6)))


@dataclass(slots=True)
class PrefillBudget:
    """One step's prompt tokens: `tokens` for any prefill; while streams decode, `timed_tokens` for all
    prefills together (the step-time bound, or the floor if larger) and `long_tokens` for chunks of
    long prompts (the bound alone)."""

    tokens: int
    timed_tokens: int | None = None  # None: no stream decodes, prompts take the whole budget
    long_tokens: int | None = None

    def share(self, num_uncomputed: int, num_prefill_tokens: int) -> int:
        """How many of a prompt's remaining tokens this step can take (without taking them).

        Whether a prompt is long goes by its whole prefill (`num_prefill_tokens`, computed at admission),
        not by what remains: the last chunk of a long prompt attends over all the rest, the dearest of all.
        """
        share = min(num_uncomputed, self.tokens)
        if self.timed_tokens is not None:
            share = min(share, self.timed_tokens)
        if num_prefill_tokens > LONG_PREFILL_TOKENS and self.long_tokens is not None:
            share = min(share, self.long_tokens)
        return share

    def take(self, num_uncomputed: int, num_prefill_tokens: int) -> int:
        share = self.share(num_uncomputed, num_prefill_tokens)
        self.tokens -= share
        if self.timed_tokens is not None:
            self.timed_tokens -= share
        if num_prefill_tokens > LONG_PREFILL_TOKENS and self.long_tokens is not None:
            self.long_tokens -= share
        return share
