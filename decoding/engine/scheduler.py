"""The scheduler: which sequences compute how many tokens this step (Orca/vLLM iteration-level scheduling).

Each step has a token budget. It goes first to every running sequence's decode token, so streams keep
flowing (with draft tokens after it where speculative decoding pays: decoding/engine/speculative.py,
never at the cost of another sequence's decode); then to prefills already under way, a chunk each; then
to waiting sequences, as far as the budget, `max_num_seqs` and free KV blocks allow. A long prompt is
therefore split over several steps instead of stalling every stream.

Waiting sequences are admitted by priority (lower first, vLLM's convention), then arrival; nobody
overtakes the sequence at the head of that order. A request that has waited `priority_starvation_seconds`
goes ahead of every priority, in arrival order: a low priority delays a request by at most that bound
plus the admission of the requests that reached it earlier, never for ever. When a decode needs a block
and none is free, the running sequence with the lowest priority (the most recently admitted among equals)
is preempted: its blocks are freed and it goes back to the queue, to be recomputed (prefix caching
often finds its blocks still there). A sequence whose client has stopped reading, or whose connection
closed while a reconnect may still come (`Sequence.is_paused`), keeps its place and its blocks but is not
scheduled, nor admitted from the queue, and is the first to be preempted.

While streams are decoding, prefill chunks are also held to a time budget: a step may take at most
`max_itl_stretch` times as long as a decode-only step, so prompts arriving never stretch the running
streams' inter-token gaps past that — a wave of new prompts is spread over steps instead of landing in
one. Short prompts (up to LONG_PREFILL_TOKENS to compute when admitted, prefix-cache hits aside) may
always take PREFILL_FLOOR_SECONDS of a step, so that at a few streams, whose short steps allow only a
handful of prompt tokens, the batch still grows as fast as requests come. Prompts waiting also earn
short ones more of a step: the extra time allowed grows with the ratio of sequences awaiting their
first token to decoding ones (up to twice the bound's), and once they are as many, short prompts are
not held at all (a burst: its last first token is bounded by the whole burst's prefill, and holding it
to the bound added a second to it at 32 streams). A burst stays one until each of its prompts has its
first token, even after the first of them decode and outnumber the rest; prompts arriving meanwhile
are held to the bound. Each stream then sees a burst as one long gap rather than many stretched ones,
which keeps its 99th-percentile gap within the bound — hence steps of up to 1024 tokens by default.
Long prompts (the whole prompt stays long to its last chunk) always get the bound alone. The engine
reports each step's duration; the scheduler fits what a decode row and a prompt token cost
(StepCostModel) and sizes the prefill share from that. (CPU steps are compute-bound: time grows linearly
with the tokens in the step.)
Chunk sizes never change any sequence's numbers (the kernels are batch-invariant), only its timing.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvcache.manager import BlockCopy, KVCacheManager

from .sequence import Sequence, SequenceStatus
from .speculative import MAX_NGRAM, DraftCostModel, NgramDrafter


@dataclass(slots=True)
class _PrefillBudget:
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


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    token_ids: list[int]  # the tokens whose KV this step computes, at positions num_computed_tokens…
    samples: bool  # the chunk reaches the sequence's end: its last row's logits pick the next token
    num_draft_tokens: int = 0  # a decode's speculative tail: every row is sampled, to verify them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_decode_tokens: int = 0  # decodes and their draft tokens
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


LONG_PREFILL_TOKENS = 512
# While streams decode, prompts may always take this much of a step, whatever the stretch bound allows:
# a few streams make a short decode step, whose bound would admit a handful of prompt tokens a step, and
# a queue would drain slower than requests arrive (throttled to the bound alone, a soak ran 2-5
# requests while ~60 waited). It costs those few streams a gap of at most this much more.
PREFILL_FLOOR_SECONDS = 0.02


class StepCostModel:
    """What a step costs: seconds ≈ base + per_row × decode rows + per_token × prompt tokens.

    One linear model over every step, fitted by exponentially weighted least squares (a CPU step is
    compute-bound: its time grows with the rows it computes), so that a churning batch of 10 to 32
    sequences is priced at its size and a step's prompt tokens are told apart from its decodes. Steps
    that mix both teach the decode rows' price too: when a wave of prompts arrives, every step for a
    while carries a prefill, and a decode line learned only from decode-only steps was priced at the
    batch of the last ones (one row, a warm-up), which sized the wave's chunks at a fifth of what the
    bound allows and left its last prompts seconds without a first token. Where the recent steps do
    not tell two coefficients apart (a steady batch, no prompts), a light ridge keeps them where they
    were. The latest chunk's cost per token is kept as well: a long prompt's tokens grow dearer as it
    goes on (attention reads its whole context).
    """

    MIN_PREFILL_CHUNK = 4  # tokens: a long prompt always makes progress
    # Steps whose prompt tokens are fewer than this teach nothing: a step's jitter divided by 4 tokens
    # made them look several times dearer, the next chunks smaller, every step then carried a sliver of
    # prompt and the batch collapsed.
    MIN_LEARNING_CHUNK = 16
    # Chunks are planned to this share of the allowed extra time: a decode step's own time varies by
    # ±20% on a busy machine and grows as the streams' contexts do, so planning to the full allowance
    # put the largest gaps at ~2.7x the median before the prompt arrived (2000 tokens under 16 streams);
    # at 0.8, ~2.3-2.6x (0.7 gained nothing more: the rest is the machine's jitter).
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


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_itl_stretch: float | None = 2.0, speculative: str = "off",
                 max_draft_tokens: int = 8, priority_starvation_seconds: float | None = None) -> None:  # fmt: skip
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs: every decode needs a slot")
        self.kv = kv
        self.speculative = speculative  # "off", "auto" (while drafts pay, by `draft_costs`) or "ngram"
        self.max_draft_tokens = max_draft_tokens
        self.draft_costs = DraftCostModel()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: prefill chunks take whatever budget the decodes leave (throughput over smoothness)
        self.step_costs = StepCostModel(max_itl_stretch) if max_itl_stretch else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: among equal priorities the newest is preempted first
        self.num_preemptions = 0
        self.priority_starvation_seconds = priority_starvation_seconds
        self._burst: set[int] = set()  # the sequences of the burst being prefilled (_burst_tokens_left)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def num_reserved_seqs(self) -> int:
        """Running sequences, counting the choices each unforked request will add (of `max_num_seqs`)."""
        return sum(_num_seqs_reserved_by(seq) for seq in self.running)

    def remove(self, seq: Sequence, latest_step_ran: bool = True) -> None:
        """Take a finished or aborted sequence out of the queues and release its blocks (publishing the
        KV its latest step computed only if that step ran: see `KVCacheManager.free`)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id, latest_step_ran)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        num_decodes = self._schedule_decodes(out)
        out.num_decode_tokens = num_decodes
        budget = _PrefillBudget(self.max_num_batched_tokens - num_decodes)
        num_decoding = num_decodes - out.num_draft_tokens
        if num_decoding and self.step_costs is not None:
            costs = self.step_costs
            budget.long_tokens = costs.prefill_budget_while_decoding(budget.tokens, num_decoding)
            awaiting = self._awaiting_first_token()
            burst_left = self._burst_tokens_left(awaiting, num_decoding)
            if burst_left is not None:  # short prompts of the burst fill the step (first tokens first)
                budget.timed_tokens = burst_left
            else:
                # the queue earns the streams a little more stretch: up to twice the bound's extra time
                # as the prompts awaiting their first token approach the decoding streams in number
                stretch = costs.max_itl_stretch + (costs.max_itl_stretch - 1.0) * len(awaiting) / num_decoding
                budget.timed_tokens = max(costs.prefill_budget_while_decoding(budget.tokens, num_decoding, stretch),
                                          costs.prefill_floor_tokens(budget.tokens))
        self._schedule_prefills(out, budget)
        if not out.preempted:  # admitting right after preempting would only trade one for another
            self._admit(out, budget)
        return out

    def _awaiting_first_token(self) -> list[Sequence]:
        """Sequences waiting for admission or in the middle of their prefill."""
        return [*self.waiting, *(seq for seq in self.running if not seq.is_prefill_done)]

    def _burst_tokens_left(self, awaiting: list[Sequence], num_decoding: int) -> int | None:
        """Prompt tokens this step may take beyond the step-time bound for a burst; None: no burst.

        A burst is as many prompts awaiting their first token as streams decoding (a wave arriving
        together). Its prompts are prefilled at once and stay a burst after the first of them start
        decoding and outnumber the rest (split so, the rest came a chunk a step and waited seconds more
        for a first token). Prompts arriving after it began are held to the bound as usual.
        """
        if len(awaiting) >= num_decoding:
            self._burst = {seq.seq_id for seq in awaiting}
            return sum(seq.num_uncomputed_tokens for seq in awaiting)
        members = [seq for seq in awaiting if seq.seq_id in self._burst]
        if not members:
            self._burst = set()
            return None
        return sum(seq.num_uncomputed_tokens for seq in members)

    def observe_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """The engine reports how long a scheduled step took (it sizes later prefill chunks, and
        tells whether drafts pay)."""
        num_prefill = scheduled.num_tokens - scheduled.num_decode_tokens
        if self.step_costs is not None:
            self.step_costs.observe(scheduled.num_decode_tokens, num_prefill, seconds)
        if num_prefill == 0 and scheduled.num_decode_tokens:
            num_decodes = scheduled.num_decode_tokens - scheduled.num_draft_tokens
            self.draft_costs.observe(num_decodes, scheduled.num_decode_tokens, seconds)

    def _draft(self, seq: Sequence, max_tokens: int, acceptance_needed: float | None, num_drafted: int) -> list[int]:
        """Draft tokens for a decode this step (at most `max_tokens`; `num_drafted` draft tokens so far
        this step): none when speculation is off, a tool call may begin (its grammar attaches at a
        token a draft could skip past), or (auto) its drafts would cost more compute than they save
        (`acceptance_needed` at this step's size, None while unmeasured)."""
        if self.speculative == "off" or seq.params.call_trigger is not None:
            return []
        params = seq.params
        # the step also produces the token after the drafts: both must fit max_tokens and the context
        max_tokens = min(max_tokens, self.max_draft_tokens, params.max_tokens - len(seq.output_ids) - 1,
                         self.kv.max_model_len - seq.num_tokens - 1)  # fmt: skip
        if max_tokens <= 0:
            return []
        if seq.drafter is None:
            seq.drafter = NgramDrafter(seq.all_token_ids(), MAX_NGRAM, self.max_draft_tokens)
        if self.speculative == "auto":
            # unmeasured at this batch size: one sequence's draft a step measures what drafts cost
            measured_enough = acceptance_needed is None and num_drafted > 0
            if measured_enough or (acceptance_needed is not None and seq.drafter.acceptance <= acceptance_needed):
                seq.drafter.shadow(max_tokens)  # learns what it would have accepted, at no cost
                return []
        drafts = seq.drafter.propose(max_tokens)
        if drafts and not self.kv.can_append(seq.seq_id, 1 + len(drafts)):
            return []  # nobody is preempted for a draft
        return drafts

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        num_scheduled = 0
        num_candidates = len(self.running)
        acceptance_needed = self.draft_costs.acceptance_needed(num_candidates) if self.speculative == "auto" else None
        for position, seq in enumerate(list(self.running)):
            if seq.status != SequenceStatus.RUNNING or not (seq.is_prefill_done and seq.num_uncomputed_tokens == 1):
                continue
            if seq.is_paused:  # it keeps its blocks; it goes on once its client reads
                continue
            if num_scheduled == self.max_num_batched_tokens:  # only if forks outgrew admission's count
                self._preempt(seq, out)  # the loop goes oldest first: the newest give way
                continue
            while not self.kv.can_append(seq.seq_id, 1):
                victim = self._preemption_victim()
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            # a decode token for every sequence still to come goes before any draft
            drafts = self._draft(seq, self.max_num_batched_tokens - num_scheduled - (num_candidates - position),
                                 acceptance_needed, out.num_draft_tokens)
            out.chunks.append(self._chunk(seq, 1, out, drafts))
            num_scheduled += 1 + len(drafts)
            out.num_draft_tokens += len(drafts)
        return num_scheduled

    def _schedule_prefills(self, out: SchedulerOutput, budget: _PrefillBudget) -> None:
        for seq in self.running:
            if budget.tokens == 0:
                break
            if (seq.is_prefill_done and seq.num_uncomputed_tokens <= 1) or seq.is_paused:
                continue  # a decode, already scheduled (or preempted) above; or its reader lags
            num_tokens = budget.take(seq.num_uncomputed_tokens, seq.num_prefill_tokens)
            if num_tokens:
                out.chunks.append(self._chunk(seq, num_tokens, out))

    def _preemption_victim(self) -> Sequence:
        """A paused sequence (nobody is waiting for its tokens now), else the running sequence of the lowest
        priority (highest value); the newest among equals."""
        running = self.running
        return running[max(range(len(running)), key=lambda i: (running[i].is_paused, running[i].request.priority, i))]

    def next_waiting(self, now: float | None = None) -> Sequence | None:
        """The waiting sequence to admit next: by priority then arrival, the starved first; never a paused
        one (admitted, it would only hold blocks), so None where every waiting sequence is paused."""
        candidates = [seq for seq in self.waiting if not seq.is_paused]
        if not candidates:
            return None
        starvation = self.priority_starvation_seconds
        if starvation is None:
            return min(candidates, key=_admission_order)
        starved_since = (time.monotonic() if now is None else now) - starvation
        return min(candidates, key=lambda seq: (seq.request.arrival_time > starved_since, *_admission_order(seq)))

    def _admit(self, out: SchedulerOutput, budget: _PrefillBudget) -> None:
        num_reserved = self.num_reserved_seqs
        now = time.monotonic()
        while self.waiting:
            seq = self.next_waiting(now)
            if seq is None:
                break
            if num_reserved + _num_seqs_reserved_by(seq) > self.max_num_seqs:
                break
            token_ids = seq.all_token_ids()
            # prompt logprobs need every prompt row's logits: nothing of the prompt may come from the cache
            use_cache = seq.params.prompt_logprobs is None or bool(seq.output_ids)
            if not budget.share(len(token_ids), len(token_ids)) or not self.kv.can_allocate(token_ids, use_cache):
                break  # nobody overtakes the head of the queue (a big prompt would wait for ever)
            self.waiting.remove(seq)
            num_cached = self.kv.allocate(seq.seq_id, token_ids, use_cache)
            seq.num_computed_tokens = num_cached
            if seq.index == 0 and seq.num_preemptions == 0:  # a recompute finds its own blocks: not a hit
                seq.request.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            seq.num_prefill_tokens = seq.num_uncomputed_tokens
            self.running.append(seq)
            num_reserved += _num_seqs_reserved_by(seq)
            num_tokens = budget.take(seq.num_uncomputed_tokens, seq.num_prefill_tokens)
            if num_tokens:
                out.chunks.append(self._chunk(seq, num_tokens, out))

    def _chunk(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
               drafts: list[int] | None = None) -> ScheduledChunk:  # fmt: skip
        begin = seq.num_computed_tokens
        token_ids = seq.token_ids(begin, begin + num_tokens) + (drafts or [])
        out.block_copies.extend(self.kv.append_slots(seq.seq_id, token_ids))
        return ScheduledChunk(seq, token_ids, samples=begin + num_tokens == seq.num_tokens,
                              num_draft_tokens=len(drafts or ()))  # fmt: skip

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)


def _admission_order(seq: Sequence) -> tuple[int, float, int]:
    """Priority, then arrival (a preempted sequence keeps its request's), then choice index."""
    request = seq.request
    return request.priority, request.arrival_time, seq.index


def _num_seqs_reserved_by(seq: Sequence) -> int:
    """Running slots a sequence stands for: a request's first sequence, until its prompt is done and
    the other choices fork from it, holds room for all n, so forks never exceed `max_num_seqs`."""
    request = seq.request
    if seq.output_ids or len(request.sequences) >= request.params.n:
        return 1
    return request.params.n - len(request.sequences) + 1
