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
not held at all (a burst: its last first token is bounded by the whole burst's prefill, which holding
it to the bound would only lengthen). A burst stays one until each of its prompts has its
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
from collections.abc import Iterable

from kvcache.manager import KVCacheManager

from .embedding_lane import EmbeddingLane
from .sequence import Sequence, SequenceStatus
from .speculative import MAX_NGRAM, DraftCostModel, NgramDrafter
from .step import ScheduledChunk, ScheduledStep, StepResult
from .step_costs import PrefillBudget, StepCostModel


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
        self.embedding_lane: EmbeddingLane | None = None  # embedding inputs take what prompts leave of a step

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or (self.embedding_lane is not None and self.embedding_lane.has_work)

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

    def schedule(self) -> ScheduledStep:
        out = ScheduledStep()
        num_decodes = self._schedule_decodes(out)
        out.num_decode_tokens = num_decodes
        budget = PrefillBudget(self.max_num_batched_tokens - num_decodes)
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
        if self.embedding_lane is not None:
            out.embeddings = self.embedding_lane.schedule(budget, start_inputs=not out.preempted)
        for chunk in out.chunks:
            for fork in chunk.forks:
                self.add_running(fork)
        return out

    def update_from_output(self, step: ScheduledStep, result: StepResult, finished: Iterable[Sequence] = ()) -> int:
        """After the step ran and its tokens were published: each chunk's sequence advances over the
        tokens whose KV it computed (a decode's accepted drafts included, the rejected ones' KV rolled
        back), its drafter learns the drafts' fate and the tokens produced, and the `finished` sequences
        leave the queues and free their blocks. Returns the prompt positions computed for the first
        time: each counts once per request (a recompute after a preemption is not new work asked for,
        and positions the prefix cache held at admission were never computed here)."""
        num_new_prompt_tokens = 0
        for chunk, chunk_result in zip(step.chunks, result.chunks, strict=True):
            seq = chunk.seq
            num_rejected = chunk.num_draft_tokens - chunk_result.num_accepted_drafts
            if num_rejected:
                self.kv.rollback(seq.seq_id, num_rejected)
            seq.num_computed_tokens += chunk.num_tokens - num_rejected
            for fork in chunk.forks:
                fork.num_computed_tokens = seq.num_computed_tokens
            if seq.drafter is not None and chunk.num_draft_tokens:
                seq.drafter.record(chunk.num_draft_tokens, chunk_result.num_accepted_drafts)
            for sampled in chunk_result.sampled:
                if sampled.seq.drafter is not None and sampled.seq.finish_reason is None:
                    for token in sampled.token_ids:
                        sampled.seq.drafter.append(token)
            request = seq.request
            computed = min(seq.num_computed_tokens, len(request.prompt_ids))
            if computed > request.num_prompt_tokens_computed:
                first_new = max(request.num_prompt_tokens_computed, request.num_cached_tokens)
                num_new_prompt_tokens += max(0, computed - first_new)
                request.num_prompt_tokens_computed = computed
        for seq in finished:
            self.remove(seq)
        return num_new_prompt_tokens

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

    def observe_step(self, scheduled: ScheduledStep, seconds: float) -> None:
        """The engine reports how long a scheduled step took (it sizes later prefill chunks, and
        tells whether drafts pay)."""
        num_prefill = scheduled.num_tokens + scheduled.num_embedding_tokens - scheduled.num_decode_tokens
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
        answer_constrained = params.constraint is not None
        if seq.reasoning is not None and (room := seq.reasoning.draft_room(answer_constrained)) is not None:
            max_tokens = min(max_tokens, room)  # the next token's grammar may change inside the thinking
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
        if seq.reasoning is not None:
            drafts = seq.reasoning.cut_drafts(drafts, answer_constrained)
        if drafts and not self.kv.can_append(seq.seq_id, 1 + len(drafts)):
            return []  # nobody is preempted for a draft
        return drafts

    def _schedule_decodes(self, out: ScheduledStep) -> int:
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

    def _schedule_prefills(self, out: ScheduledStep, budget: PrefillBudget) -> None:
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

    def _admit(self, out: ScheduledStep, budget: PrefillBudget) -> None:
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

    def _chunk(self, seq: Sequence, num_tokens: int, out: ScheduledStep,
               drafts: list[int] | None = None) -> ScheduledChunk:  # fmt: skip
        begin = seq.num_computed_tokens
        token_ids = seq.token_ids(begin, begin + num_tokens) + (drafts or [])
        out.block_copies.extend(self.kv.append_slots(seq.seq_id, token_ids))
        chunk = ScheduledChunk(seq, begin, token_ids, samples=begin + num_tokens == seq.num_tokens,
                               num_draft_tokens=len(drafts or ()))  # fmt: skip
        request = seq.request
        if chunk.samples and not seq.output_ids and len(request.sequences) < request.params.n:
            # the prompt ends this step: the other choices share its blocks (running from the end of
            # schedule(); their reservation was held by this sequence)
            for index in range(len(request.sequences), request.params.n):
                fork = seq.fork(index)
                self.kv.fork(seq.seq_id, fork.seq_id)
                request.sequences.append(fork)
                chunk.forks.append(fork)
        return chunk

    def _preempt(self, seq: Sequence, out: ScheduledStep) -> None:
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
