"""The output stage: the requests the engine holds, and what their clients see of each step.

`OutputProcessor` owns the registry of unfinished requests. For every token a step produced it lets
the choice's grammar take it, appends it, detokenizes, checks the stop conditions, counts it and
publishes the delta on the request's stream. Every way a request ends — a stop condition on its
last choice, an abort, an error, a queue timeout, shutdown — goes through `end_request` or
`_publish`, so usage, the observers' `on_request_finished` and `on_request_done` happen exactly once.
It never touches the scheduler: it returns the sequences that finished and the engine frees them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from .detokenizer import IncrementalDetokenizer
from .observers import EngineObserver, EngineStats, notify
from .outputs import FinishReason, RequestOutput, Usage
from .reasoning import Phase, ReasoningTracker
from .sampling import TokenLogprobs
from .sequence import Request, Sequence, find_stop, partial_stop_suffix, seed_generator
from .step import ScheduledChunk, ScheduledStep, StepResult
from .structured import GrammarState, Guide


class OutputProcessor:
    def __init__(self, tokenizer: object, guide: Guide, eos_token_ids: tuple[int, ...], max_model_len: int,
                 stats: EngineStats, observers: list[EngineObserver], on_request_done: Callable[[], None]) -> None:
        """`on_request_done` is called once per request, when its last output is put."""
        self.tokenizer = tokenizer
        self.guide = guide
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = stats
        self.observers = observers
        self.on_request_done = on_request_done
        self.requests: dict[str, Request] = {}  # unfinished, by id

    def add(self, request: Request) -> Sequence:
        """Register a request; returns its first choice's sequence (the others fork when its prompt is done)."""
        self.requests[request.request_id] = request
        params = request.params
        seq = Sequence(request, 0, IncrementalDetokenizer(self.tokenizer, request.prompt_ids,  # type: ignore[arg-type]
                                                          params.skip_special_tokens),
                       seed_generator(params.seed, 0))  # fmt: skip
        if params.reasoning is not None:
            reasoning = params.reasoning
            if reasoning.initial is Phase.MAYBE and reasoning.markers.start_id is None and params.constraint:
                # an opening spelled in text cannot be allowed beside the grammar: the answer is held to it at once
                reasoning = replace(reasoning, initial=Phase.ANSWERING)
            seq.reasoning = ReasoningTracker(reasoning)
        request.sequences.append(seq)
        return seq

    def process(self, step: ScheduledStep, result: StepResult) -> list[Sequence]:
        """Publish what the step produced; returns the sequences that finished (to be freed)."""
        finished: list[Sequence] = []
        for chunk, chunk_result in zip(step.chunks, result.chunks, strict=True):
            if chunk_result.prompt_logprobs is not None:
                _record_prompt_logprobs(chunk, chunk_result.prompt_logprobs)
            for sampled in chunk_result.sampled:
                seq = sampled.seq
                for token, logprobs, is_dead_end in zip(sampled.token_ids, sampled.logprobs, sampled.dead_ends,
                                                        strict=True):  # fmt: skip
                    if seq.finish_reason is not None:  # a stop condition, or another choice's error, ended it
                        break
                    finished += self._produce(seq, token, logprobs, is_dead_end)
        return finished

    def _produce(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, is_dead_end: bool) -> list[Sequence]:
        """A token drawn for the choice: its grammar (if any) takes it, then it is emitted."""
        grammar, trigger, reasoning = seq.grammar, seq.params.call_trigger, seq.reasoning
        complete = False
        if grammar is not None and grammar.also_allowed == token:
            seq.grammar = None  # the model opened its thinking: the answer's grammar waits for its end
        elif grammar is not None:
            if is_dead_end or not grammar.consume(token, self.guide):
                return self.end_request(seq.request, FinishReason.ERROR,
                                        f"structured output: the grammar allows no further token ({grammar.error})")
            grammar.also_allowed = None
            complete = grammar.is_complete
            if complete and (grammar.ends_reasoning or seq.params.constraint is None):
                seq.grammar, complete = None, False  # the thinking, or a call under auto, is over
        elif trigger is not None and token == trigger.token_id and (reasoning is None or reasoning.is_answering):
            seq.grammar = GrammarState.start(self.guide, trigger.arguments, is_json=True)  # the call's arguments
        return self._publish(seq, self._append(seq, token, logprobs, complete))

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                grammar_complete: bool) -> RequestOutput:  # fmt: skip
        """Append a produced token to its choice; returns the delta (with finish_reason if it ended).
        `grammar_complete`: the choice's structured-output grammar accepts nothing after this token."""
        request, params = seq.request, seq.params
        now = time.monotonic()
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        seq.output_ids.append(token)
        logprob_list = [logprobs] if logprobs is not None else []

        reasoning = ""

        def ended(reason: FinishReason, stop_reason: str | int | None = None, flush: bool = True) -> RequestOutput:
            out = _finish_output(seq, reason, stop_reason, flush_text=flush)
            out.token_ids, out.logprobs = [token], logprob_list
            out.reasoning = reasoning + out.reasoning
            return out

        # vLLM's min_tokens: no stop condition ends a choice before min_tokens tokens precede the one that
        # ends it (the sampler masks EOS and the stop token ids until then; stop strings are not looked for).
        can_stop = len(seq.output_ids) > params.min_tokens
        if can_stop and token in self.eos_token_ids and not params.ignore_eos:
            return ended(FinishReason.STOP)
        if can_stop and token in params.stop_token_ids:
            return ended(FinishReason.STOP, token)
        piece = seq.detokenizer.add(token)
        if seq.reasoning is not None:  # the thinking's text bypasses the stop strings: they are the answer's
            reasoning, piece = seq.reasoning.feed(token, piece)
        num_held = len(seq.held_text)
        text = seq.held_text + piece
        if params.stop:
            # A match must take in this token's text: held text never holds a whole stop string, unless one
            # that completed before min_tokens (and so does not count).
            match = find_stop(text, params.stop, num_held) if can_stop else None
            if match is not None:
                start, stop = match
                seq.held_text = ""
                out = ended(FinishReason.STOP, stop, flush=False)
                out.text = text[: start + len(stop) if params.include_stop_str_in_output else start]
                return out
            hold = partial_stop_suffix(text, params.stop)
            text, seq.held_text = text[: len(text) - hold], text[len(text) - hold :]
        else:
            seq.held_text = ""
        if grammar_complete or len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            out = ended(FinishReason.STOP if grammar_complete else FinishReason.LENGTH)
            out.text = text + out.text
            return out
        return RequestOutput(request.request_id, seq.index, text=text, reasoning=reasoning, token_ids=[token],
                             logprobs=logprob_list)  # fmt: skip

    def _publish(self, seq: Sequence, output: RequestOutput) -> list[Sequence]:
        request = seq.request
        now = request.last_token_time or time.monotonic()
        if output.token_ids:
            self.stats.num_generation_tokens += 1
            if len(seq.output_ids) == 1 and seq.index == 0:
                notify(self.observers, "on_first_token", now - request.arrival_time)
        if request.prompt_logprobs is not None and seq.index == 0 and len(seq.output_ids) == 1:
            output.prompt_logprobs = request.prompt_logprobs
        if output.finish_reason is None:
            request.stream.put(output)
            return []
        self._put_last_of_choice(request, output)
        return [seq]

    def end_request(self, request: Request, reason: FinishReason, error: str | None = None) -> list[Sequence]:
        """End every unfinished choice of a request (its abort, an error, a timeout, shutdown), the choices
        of n > 1 not yet forked included. Returns the sequences that ended (to be freed)."""
        if request.request_id not in self.requests:
            return []
        ended = [seq for seq in request.sequences if seq.finish_reason is None]
        outputs = [_finish_output(seq, reason, error=error, flush_text=False) for seq in ended]
        outputs += [RequestOutput(request.request_id, index, finish_reason=reason, error=error)
                    for index in range(len(request.sequences), request.params.n)]  # fmt: skip
        for output in outputs:
            self._put_last_of_choice(request, output)
        return ended

    def _put_last_of_choice(self, request: Request, output: RequestOutput) -> None:
        request.num_finished_choices += 1
        is_last = request.is_finished
        if is_last:
            output.usage = usage_of(request)
            del self.requests[request.request_id]
            self._request_done(request, output.finish_reason or FinishReason.STOP)
        request.stream.put(output, is_last=is_last)

    def end_stream(self, request: Request, error: str) -> None:
        """After an error whose scope is unknown: put an error as the last output of each of the request's
        unfinished choices, trusting none of the engine's state about them (the registry included: the
        caller forgets what it must)."""
        finished = {seq.index for seq in request.sequences if seq.finish_reason is not None}
        unfinished = [i for i in range(request.params.n) if i not in finished]
        for position, index in enumerate(unfinished):
            is_last = position == len(unfinished) - 1
            output = RequestOutput(request.request_id, index, finish_reason=FinishReason.ERROR, error=error)
            if is_last:
                output.usage = usage_of(request)
                self._request_done(request, FinishReason.ERROR)
            request.stream.put(output, is_last=is_last)

    def _request_done(self, request: Request, reason: FinishReason) -> None:
        self.on_request_done()
        notify(self.observers, "on_request_finished", request, reason)


def _finish_output(seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None,
                   error: str | None = None, flush_text: bool = True) -> RequestOutput:  # fmt: skip
    """The closing delta of a choice: whatever text was held back, and why it ended."""
    reasoning = ""
    text = seq.detokenizer.flush() if flush_text else ""
    if seq.reasoning is not None and flush_text:
        reasoning, text = seq.reasoning.feed(None, text)
        held_reasoning, held_text = seq.reasoning.flush()
        reasoning, text = reasoning + held_reasoning, text + held_text
    text = seq.held_text + text if flush_text else ""
    seq.held_text = ""
    seq.finish_reason = reason
    return RequestOutput(seq.request.request_id, seq.index, text=text, reasoning=reasoning, finish_reason=reason,
                         stop_reason=stop_reason, error=error)  # fmt: skip


def _record_prompt_logprobs(chunk: ScheduledChunk, entries: list[TokenLogprobs]) -> None:
    request = chunk.seq.request
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None]  # nothing predicts the first token
    del request.prompt_logprobs[chunk.position + 1 :]  # a prompt preempted mid-prefill records its rows again
    request.prompt_logprobs.extend(entries)


def usage_of(request: Request) -> Usage:
    first = request.first_token_time
    last = request.last_token_time or first
    return Usage(len(request.prompt_ids), request.num_completion_tokens, request.num_cached_tokens,
                 *request.draft_token_counts, reasoning_tokens=request.num_reasoning_tokens,
                 prompt_seconds=first - request.arrival_time if first else 0.0,
                 decode_seconds=last - first if first and last else 0.0)
