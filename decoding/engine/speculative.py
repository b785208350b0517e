"""Speculative decoding from the context: n-gram drafts, and when they pay.

A decoding sequence often repeats its own context — an edited file it was shown, a quoted document,
a JSON structure it already wrote. `NgramDrafter` keeps, for every n-gram (n = 1..max_n) of the
sequence's tokens, where it last occurred; the longest n-gram ending the sequence that occurred
before proposes the tokens that followed it then. Each token updates the index in O(max_n): no
rescans of the context.

The engine verifies a draft in the ordinary model step, as a short chunk beside everyone else, and
keeps the longest prefix that plain decoding would have produced plus the token plain decoding
produces after it (`Engine._verify`), so speculation never changes what a request generates.

It is not free: a draft's tokens are computed whether or not they are accepted. `DraftCostModel`
compares recent decode steps with drafts and without, at about the same batch size, for the cost of
a token and the base a step pays anyway; a draft token is worth its compute when the chance it is accepted exceeds the
share of the coming step's time that per-token compute takes — near zero for one stream, whose step
is bound by reading the weights, near one for a full batch, which is bound by compute. Each drafter estimates
its acceptance rate from its verified drafts and, while it is not speculating, from the drafts it
would have proposed (compared with the tokens that came), so a sequence that starts repeating its
context is noticed at no cost.
"""

from __future__ import annotations

MAX_NGRAM = 3
MAX_DRAFT_TOKENS = 8
_ACCEPTANCE_SMOOTHING = 0.3
_INITIAL_ACCEPTANCE = 0.5


class NgramDrafter:
    """One sequence's n-gram index, its draft length and its acceptance estimate."""

    __slots__ = ("_continuations", "_shadow", "_shadow_matched", "acceptance", "max_draft_tokens", "max_n",
                 "num_accepted", "num_drafted", "num_tokens_to_draft", "tokens")

    def __init__(self, tokens: list[int], max_n: int = MAX_NGRAM, max_draft_tokens: int = MAX_DRAFT_TOKENS) -> None:
        self.max_n = max_n
        self.max_draft_tokens = max_draft_tokens
        self.tokens: list[int] = []
        self._continuations: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.num_tokens_to_draft = min(2, max_draft_tokens)  # adapted to the acceptance (1..max_draft_tokens)
        self.acceptance = _INITIAL_ACCEPTANCE  # moving average of the share of drafted tokens accepted
        self.num_drafted = 0  # verified in model steps
        self.num_accepted = 0
        self._shadow: list[int] = []  # a draft not run: compared with the tokens that come instead
        self._shadow_matched = 0
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """The sequence's next token (prompt or generated)."""
        end = len(self.tokens)
        for n in range(1, min(self.max_n, end) + 1):  # the n-grams ending before it now have a continuation
            self._continuations[tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)
        if self._shadow:
            matches = token == self._shadow[self._shadow_matched]
            self._shadow_matched += matches
            if not matches or self._shadow_matched == len(self._shadow):
                self._observe(len(self._shadow), self._shadow_matched)
                self._shadow = []

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest n-gram
        ending the sequence; [] when none occurred."""
        num = min(self.num_tokens_to_draft, max_tokens)
        if num <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_n, end), 0, -1):
            at = self._continuations.get(tuple(self.tokens[end - n :]))
            if at is not None:
                return self.tokens[at : at + num]
        return []

    def shadow(self, max_tokens: int) -> None:
        """Propose a draft that will not run, to learn the acceptance it would have had."""
        if not self._shadow:
            self._shadow = self.propose(max_tokens)
            self._shadow_matched = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A draft was verified: `num_accepted` of its `num_drafted` tokens were what decoding produced."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self._shadow = []
        self._observe(num_drafted, num_accepted)

    def _observe(self, num_drafted: int, num_accepted: int) -> None:
        self.acceptance += _ACCEPTANCE_SMOOTHING * (num_accepted / num_drafted - self.acceptance)
        if num_accepted == num_drafted:  # all taken: try longer drafts
            self.num_tokens_to_draft = min(self.max_draft_tokens, 2 * self.num_tokens_to_draft)
        else:
            self.num_tokens_to_draft = max(1, num_accepted + 1)


class DraftCostModel:
    """What a draft token costs in a decode step, per batch size range (1, 2-3, 4-7, 8-15, ...
    decoding sequences): a step of one sequence is bound by reading the weights and its extra rows
    cost little, one of 32 is bound by compute, and one estimate across both regimes misjudges each.

    Within a range, moving averages per decoding sequence are kept apart for steps with drafts
    (tokens and seconds) and steps without (seconds, for one token); the cost of a token is their
    difference in seconds over their difference in tokens, and the steps without drafts give the
    base. The base follows every plain step (the contexts grow); the drafted side keeps its last
    measurement while nobody drafts."""

    # Drafts are measured over this many steps before the measurement is trusted (one noisy step could
    # otherwise stop them for good), and measured again after this many steps without any.
    MIN_DRAFTED_STEPS = 8
    REMEASURE_AFTER_STEPS = 1000

    def __init__(self) -> None:
        self._ranges: dict[int, _BatchSizeRange] = {}  # by the bit length of the number of decodes

    def observe(self, num_decodes: int, num_tokens: int, seconds: float) -> None:
        """A step of `num_decodes` decoding sequences that computed `num_tokens` tokens (drafts included)."""
        steps = self._ranges.setdefault(num_decodes.bit_length(), _BatchSizeRange())
        if num_tokens > num_decodes:
            steps.drafted.add(num_tokens / num_decodes, seconds / num_decodes)
            steps.plain_steps_since_drafts = 0
        else:
            steps.plain.add(1.0, seconds / num_decodes)
            steps.plain_steps_since_drafts += 1

    def acceptance_needed(self, num_decodes: int) -> float | None:
        """The acceptance rate above which a draft token adds throughput to a step of `num_decodes`
        decodes: the share of that step's time its per-token compute takes, plus a margin. None while
        steps of that size have not been measured with drafts and without (a few drafts then
        measure), and again once the drafts' measurement is old."""
        steps = self._ranges.get(num_decodes.bit_length())
        if steps is None or steps.plain.count == 0 or steps.drafted.count < self.MIN_DRAFTED_STEPS:
            return None
        plain, drafted = steps.plain, steps.drafted
        if steps.plain_steps_since_drafts > self.REMEASURE_AFTER_STEPS:
            drafted.count = 0  # measure again: the drafts' cost moves with the contexts and the machine
            return None
        if drafted.tokens <= plain.tokens + 0.1:
            return None
        per_token = max(0.0, (drafted.seconds - plain.seconds) / (drafted.tokens - plain.tokens))
        base = max(0.0, plain.seconds - per_token * plain.tokens)  # per decoding sequence
        return min(1.0, per_token / max(base + per_token, 1e-12) + MARGIN)


# Drafts must beat the measured break-even by this much: the estimate misses what does not grow
# linearly, so drafting just above the fitted break-even runs slower than not drafting.
MARGIN = 0.1


class _MovingMean:
    """Moving averages of a kind of step's tokens and seconds per decoding sequence: the plain mean
    of the first ten, then exponential."""

    _SMOOTHING = 0.1

    def __init__(self) -> None:
        self.count = 0
        self.tokens = 0.0
        self.seconds = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.count += 1
        weight = max(1.0 / self.count, self._SMOOTHING)
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)


class _BatchSizeRange:
    __slots__ = ("drafted", "plain", "plain_steps_since_drafts")

    def __init__(self) -> None:
        self.plain = _MovingMean()
        self.drafted = _MovingMean()
        self.plain_steps_since_drafts = 0
