"""The engine: one thread turning the loop — schedule → run the model step → sample → publish.

`submit()` and `abort()` may be called from any thread or from the asyncio loop: they only put
commands in a bounded inbox. The engine thread owns all engine state and applies the inbox before
anything else in every step. It is the pool's thread 0, so it takes part in every model step, and it
parks on a condition while there is nothing to do: an idle server burns no CPU.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvcache.manager import KVCacheManager
from kvcache.storage import KVCacheSpec, KVCacheStorage
from threadpool import BrokenPool, SpinPool

from ..kernels import weight_cache
from ..kernels.forward import KernelWeights, resident_weight_bytes
from ..model.model import Model
from . import memory
from .config import KV_CACHE_DTYPES, SPECULATIVE_MODES, EngineConfig, resolve_kv_cache_dtype
from .detokenizer import IncrementalDetokenizer
from .errors import EngineFailed, EngineShuttingDown, QueueFull, RequestTooLarge
from .observers import EngineObserver, EngineStats
from .output_processor import finish_output, process_token, record_prompt_logprobs, usage_of
from .outputs import RequestOutput, RequestStream
from .params import InvalidParams, SamplingParams
from .runner import ModelRunner
from .sampling import Sampler, SampleRequest, TokenLogprobs
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, Sequence, SequenceStatus, seed_generator
from .step_batch import build_step_batch
from .structured import Guide, JsonRunGuard, StructuredOutputError, apply_masks
from .validation import validate_request

# The engine's configuration and refusals travel with it: `from decoding.engine.engine import ...`.
__all__ = ["KV_CACHE_DTYPES", "Engine", "EngineConfig", "EngineFailed", "EngineObserver", "EngineShuttingDown",
           "EngineStats", "QueueFull", "RequestTooLarge", "resolve_kv_cache_dtype"]

log = logging.getLogger(__name__)


_Command = tuple[str, Any]


class Engine:
    def __init__(self, model: Model, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = cfg = config or EngineConfig()
        self.max_model_len = min(cfg.max_model_len or model.config.max_context, model.config.max_context)
        mc = model.config
        spec = KVCacheSpec(n_layers=mc.n_layers, n_kv_heads=mc.n_kv_heads, head_dim=mc.head_dim,
                           block_size=cfg.block_size, dtype=resolve_kv_cache_dtype(cfg))
        num_blocks = self._num_kv_blocks(spec)
        # Repacking holds one matrix's file pages beside its copy until the pages are released: done
        # before the KV cache is touched, that passing peak does not stack on the cache's.
        cache = weight_cache.cache_file(model.path) if cfg.weight_cache and model.path.is_file() else None
        weights = KernelWeights.build(mc, model.weights, fast=cfg.kernels == "fast", cache=cache)
        self.storage = KVCacheStorage.allocate(spec, num_blocks)
        self.kv = KVCacheManager(num_blocks, cfg.block_size, self.max_model_len, cfg.enable_prefix_caching)
        if cfg.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {cfg.speculative!r}")
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_itl_stretch,
                                   cfg.speculative, cfg.speculative_max_tokens, cfg.priority_starvation_seconds)
        self.pool = SpinPool(cfg.n_threads, pin=cfg.pin_threads)
        max_logit_rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.runner = ModelRunner(model, self.storage, self.pool, cfg.max_num_batched_tokens, max_logit_rows,
                                  cfg.kernels, weights)
        self.sampler = Sampler(mc.vocab_size, self.pool, mc.eos_token_ids)  # EOS is masked before min_tokens
        self.eos_token_ids = mc.eos_token_ids
        self.guide = Guide.for_model(model)  # structured output; llguidance loads on the first constraint
        self.stats = EngineStats()
        self.observers: list[EngineObserver] = []
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None  # tests inject step failures here
        self._requests: dict[str, Request] = {}  # engine thread only
        self._queue_deadlines: list[tuple[float, int, Request]] = []  # a heap; engine thread only
        self._inbox: deque[_Command] = deque()
        self._wakeup = threading.Condition()
        self._num_unfinished = 0  # submitted and not yet finished; guarded by _wakeup
        self.num_running_requests = 0  # requests with a sequence in the running queue, after the last step
        self.num_paused_requests = 0  # of those, requests waiting for their client to read
        self._ids = itertools.count()
        self._stopping = False
        self._is_idle = False  # the last step scheduled nothing (every running request's reader lags)
        self.failure: str | None = None  # why the engine thread ended, if it did on an error
        self._thread: threading.Thread | None = None

    def _num_kv_blocks(self, spec: KVCacheSpec) -> int:
        """The KV cache's size in blocks, from the configuration: refused where the weights and the
        cache do not fit in the memory available (decoding.engine.memory)."""
        cfg, budget = self.config, memory.available_memory()
        weights_bytes = resident_weight_bytes(self.model.weights, fast=cfg.kernels == "fast")
        if cfg.num_kv_blocks:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_mb == "auto":
            most_useful = cfg.max_num_seqs * self.max_model_len * spec.bytes_per_token
            num_blocks = memory.auto_kv_bytes(weights_bytes, most_useful, budget) // spec.bytes_per_block
            log.info("KV cache (auto): %d blocks, %.0f MiB, %d tokens — half of the %.0f MiB available (%s) "
                     "beyond %.0f MiB of weights and a %.0f MiB margin, at most what %d sequences of %d tokens fill",
                     num_blocks, num_blocks * spec.bytes_per_block / memory.MIB, num_blocks * spec.block_size,
                     budget.available / memory.MIB, budget.source, weights_bytes / memory.MIB,
                     memory.RUNTIME_MARGIN_BYTES / memory.MIB, cfg.max_num_seqs, self.max_model_len)  # fmt: skip
            if num_blocks < 1:
                memory.check_fits(weights_bytes, spec.bytes_per_block, budget)
                raise memory.NotEnoughMemory("no KV block fits beside the weights in the memory available")
        else:
            num_blocks = spec.num_blocks_for_mib(float(cfg.kv_cache_mb))
        memory.check_fits(weights_bytes, num_blocks * spec.bytes_per_block, budget)
        return num_blocks

    # ---- any thread -------------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="treadle-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None, priority: int = 0,
               queue_timeout: float | None = None) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream (async if `loop` is given).

        `priority`: lower is admitted first (see the scheduler). `queue_timeout`: seconds it may wait
        for admission; past them it ends with finish_reason "timeout" instead of being served late.
        """
        self.validate(prompt_ids, params)
        if queue_timeout is not None and not queue_timeout > 0:
            raise InvalidParams("timeout", f"timeout must be positive, got {queue_timeout}")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, loop, self.config.max_unread_bytes, on_drained=self._wake)
        with self._wakeup:
            if self.failure is not None:
                raise EngineFailed(f"the engine failed and serves nothing more: {self.failure}")
            if self._stopping:
                raise EngineShuttingDown("the engine is shutting down")
            if self._num_unfinished >= self.config.max_queue:
                raise QueueFull(f"{self._num_unfinished} requests are running or waiting (max_queue)")
            self._num_unfinished += 1
            request = Request(request_id, list(prompt_ids), params, stream, priority=priority)
            if queue_timeout is not None:
                request.queue_deadline = request.arrival_time + queue_timeout
            self._inbox.append(("add", request))
            self._wakeup.notify()
        return stream

    def _wake(self) -> None:
        """A paused request's reader caught up: schedule it again."""
        with self._wakeup:
            self._is_idle = False
            self._wakeup.notify()

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._inbox.append(("abort", request_id))
            self._wakeup.notify()

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestTooLarge` or `InvalidParams` for what could never be served."""
        validate_request(prompt_ids, params, self.model.config.vocab_size, self.max_model_len,
                         self.config.max_num_seqs, self.kv)
        for constraint in (params.constraint, params.call_trigger[1] if params.call_trigger else None):
            if constraint is None:
                continue
            try:
                self.guide.compile(constraint)  # compiled once per grammar text, then cached
            except StructuredOutputError as exc:
                raise InvalidParams(constraint.field, f"{constraint.field} cannot be compiled: {exc}") from None

    @property
    def num_unfinished(self) -> int:
        return self._num_unfinished

    @property
    def num_waiting_requests(self) -> int:
        """Submitted and not yet running: in the inbox, or waiting for admission (or preempted)."""
        return max(0, self._num_unfinished - self.num_running_requests)

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        self.pool.close()

    # ---- engine thread ----------------------------------------------------------------------------

    @property
    def is_failed(self) -> bool:
        """The engine thread ended on an error (or died): nothing it holds will ever finish."""
        return self.failure is not None or (self._thread is not None and not self._thread.is_alive()
                                            and not self._stopping)

    def _loop(self) -> None:
        failure: BaseException | None = None
        try:
            while self._wait_for_work():
                try:
                    self.step()
                except BrokenPool:
                    raise  # every later step would fail the same way: the engine is done
                except Exception as exc:  # outside the model step: which requests it concerns is unknown
                    log.exception("engine loop failed")
                    self._fail_everything(f"internal error in the engine: {type(exc).__name__}")
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._close(failure)

    # While every running request is paused for its reader, the loop parks and looks again this often
    # (a reader catching up wakes it at once); each look ends requests paused past their timeout.
    PAUSED_RECHECK_SECONDS = 1.0

    def _wait_for_work(self) -> bool:
        with self._wakeup:
            while not self._inbox and not self._stopping:
                if not self.scheduler.has_work:
                    self._wakeup.wait()
                elif not self._is_idle:
                    break
                elif not self._wakeup.wait(self.PAUSED_RECHECK_SECONDS):
                    break  # time to check the paused requests' timeouts
            return not self._stopping

    def _close(self, failure: BaseException | None) -> None:
        """The thread's last act: end every request it holds or will never take from the inbox."""
        if failure is not None:
            log.critical("the engine thread died: %s: %s", type(failure).__name__, failure)
            with self._wakeup:
                self.failure = f"{type(failure).__name__}: {failure}"
                self._stopping = True  # submit() refuses from now on, so the inbox only shrinks
            self._fail_everything(f"the engine failed: {type(failure).__name__}", include_inbox=True)
            return
        self._drain_inbox()
        for request in list(self._requests.values()):
            self._fail_request(request, "abort", "the engine shut down")

    def step(self) -> None:
        """One turn: apply the inbox, schedule, run the model, sample, publish."""
        self._drain_inbox()
        self._abort_slow_readers()
        self._end_queue_timeouts()
        try:
            self._step()
        finally:
            running = self.scheduler.running
            self.num_running_requests = len({id(seq.request) for seq in running})
            self.num_paused_requests = len({id(seq.request) for seq in running if seq.is_paused})

    def _step(self) -> None:
        with self._wakeup:
            self._is_idle = True  # until this step schedules something; a reader catching up meanwhile clears it
        scheduled = self.scheduler.schedule()
        for _ in scheduled.preempted:
            self._notify("on_preemption")
        if scheduled.preempted:
            self._is_idle = False  # it admits nothing right after preempting: the next step will
        if not scheduled.chunks:
            return
        self._is_idle = False
        started = time.perf_counter()
        try:
            if self.fault_hook is not None:
                self.fault_hook(scheduled)
            kernel_seconds = self._run_step(scheduled)
        except Exception as exc:  # a failed step ends only the requests it touched
            log.exception("engine step failed")
            for request in {id(c.seq.request): c.seq.request for c in scheduled.chunks}.values():
                self._fail_request(request, "error", f"internal error while generating: {type(exc).__name__}",
                                   latest_step_ran=False)
            if isinstance(exc, BrokenPool):
                raise
            return
        seconds = time.perf_counter() - started
        self.scheduler.observe_step(scheduled, seconds)
        self.stats.num_steps += 1
        self.stats.step_seconds += seconds
        self.stats.kernel_seconds += kernel_seconds
        self._notify("on_step", seconds, kernel_seconds, scheduled.num_tokens, len(scheduled.chunks))
        self._notify("on_step_scheduled", scheduled, seconds, kernel_seconds)

    def _run_step(self, scheduled: SchedulerOutput) -> float:
        batch, logit_row_of_chunk = build_step_batch(self.kv, scheduled)
        kernel_started = time.perf_counter()
        logits = self.runner.forward(batch)
        kernel_seconds = time.perf_counter() - kernel_started
        rows: list[int] = []
        seqs: list[Sequence] = []
        requests: list[SampleRequest] = []
        drafts_at: dict[int, list[int]] = {}  # index in `seqs` of a verified decode's first row -> its drafts
        for chunk, first_row in zip(scheduled.chunks, logit_row_of_chunk, strict=True):
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens  # accepted drafts: below
            self._count_prompt_tokens(seq)
            if seq.params.prompt_logprobs is not None and first_row >= 0 and not seq.output_ids:
                record_prompt_logprobs(seq, chunk.token_ids, logits[first_row : first_row + chunk.num_tokens])
            if chunk.num_draft_tokens:
                drafts = chunk.token_ids[1:]
                drafts_at[len(seqs)] = drafts
                for j in range(len(drafts) + 1):  # row j follows drafts[:j]: sampled as if they were output
                    rows.append(first_row + j)
                    seqs.append(seq)
                    requests.append(SampleRequest(seq.params, seq.rng, seq.prompt_ids, seq.output_ids + drafts[:j]))
            elif chunk.samples:
                last_row = first_row + (chunk.num_tokens - 1 if seq.params.prompt_logprobs is not None
                                        and not seq.output_ids else 0)
                for s in self._fork_choices(seq):
                    rows.append(last_row)
                    seqs.append(s)
                    requests.append(SampleRequest(s.params, s.rng, s.prompt_ids, s.output_ids))
        if seqs:
            rows_logits = logits[rows]  # a copy: the masks below change only it
            constrained = []
            i = 0
            while i < len(seqs):
                s, drafts = seqs[i], drafts_at.get(i, [])
                if s.params.constraint is not None or s.matcher is not None:
                    constrained.append((i, self._matcher(s), s.json_guard, drafts))
                i += 1 + len(drafts)
            dead = set(apply_masks(rows_logits, constrained, self.guide))
            rows_logits[list(dead)] = 0.0  # sampled, then dropped: the sampler needs finite rows
            rng_states = {i: seqs[i].rng.bit_generator.state for i in drafts_at if not seqs[i].params.is_greedy}
            tokens, logprobs = self.sampler.sample(rows_logits, requests)
            token_list = tokens.tolist()
            i = 0
            while i < len(seqs):
                seq = seqs[i]
                if i in drafts_at:
                    i = self._verify(seq, i, drafts_at[i], token_list, logprobs, rng_states.get(i), dead)
                    continue
                if seq.finish_reason is None:  # else a choice of its request failed below
                    self._produce(seq, token_list[i], logprobs[i], i in dead)
                i += 1
        return kernel_seconds

    def _produce(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, is_dead_end: bool) -> None:
        """A token sampled for the sequence: its grammar (if any) takes it, then it is emitted."""
        complete = False
        if seq.matcher is not None:
            if is_dead_end or not seq.matcher.consume_token(token):
                self._fail_request(seq.request, "error", "structured output: the grammar allows no "
                                   f"further token ({seq.matcher.get_error() or 'dead end'})")
                return
            complete = seq.matcher.is_stopped()
            if seq.json_guard is not None:
                seq.json_guard.add(self.guide.token_texts()[0][token])
            if complete and seq.params.constraint is None:  # a call under auto is over: free text again
                seq.matcher, seq.json_guard, complete = None, None, False
        elif seq.params.call_trigger is not None and token == seq.params.call_trigger[0]:
            seq.matcher = self.guide.matcher(seq.params.call_trigger[1])  # the call's arguments
            seq.json_guard = JsonRunGuard()
        self._emit(seq, token, logprobs, complete)

    def _verify(self, seq: Sequence, first: int, drafts: list[int], tokens: list[int],
                logprobs: list[TokenLogprobs | None], rng_state: dict | None, dead: set[int]) -> int:  # fmt: skip
        """A decode with drafts: row j was sampled after drafts[:j], as plain decoding would sample it
        had it produced them. The drafts agree with those samples up to the first that does not; the
        tokens produced are the samples up to and including that one. Their KV stays; the rejected
        drafts' is rolled back. A seeded row's generator is left as plain decoding would leave it: one
        draw per token produced. Returns the index after the group's rows."""
        end = first + len(drafts) + 1
        if seq.finish_reason is not None:  # a choice of its request failed: its blocks are gone
            return end
        num_accepted = 0
        while num_accepted < len(drafts) and tokens[first + num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        if rng_state is not None:
            seq.rng.bit_generator.state = rng_state
            seq.rng.random(num_accepted + 1)
        self.kv.rollback(seq.seq_id, len(drafts) - num_accepted)
        seq.num_computed_tokens += num_accepted
        seq.drafter.record(len(drafts), num_accepted)
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_draft_tokens += num_accepted
        for j in range(num_accepted + 1):
            if seq.finish_reason is not None:  # ended by a stop condition: what follows is not output
                break
            self._produce(seq, tokens[first + j], logprobs[first + j], first + j in dead)
        return end

    def _emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, grammar_complete: bool) -> None:
        """A token produced for the sequence: appended, checked for stops, published."""
        output = process_token(seq, token, logprobs, self.eos_token_ids, self.max_model_len, grammar_complete)
        if seq.drafter is not None:
            seq.drafter.append(token)
        self._publish(seq, output)

    def _matcher(self, seq: Sequence) -> Any:
        """The sequence's grammar state, made at its first sampled token (each choice its own)."""
        if seq.matcher is None:  # a tool call's matcher is attached when its start is drawn
            seq.matcher = self.guide.matcher(seq.params.constraint)
            if seq.params.constraint.kind in ("json", "json_object"):
                seq.json_guard = JsonRunGuard()
        return seq.matcher

    def _abort_slow_readers(self) -> None:
        """End requests whose client has read nothing for the timeout while the engine waited on it."""
        if not self.num_paused_requests:  # counted after the last step; a pause is timed in seconds
            return
        timeout = self.config.slow_reader_timeout_seconds
        now = time.monotonic()
        for request in list(self._requests.values()):
            since = request.stream.backlogged_since
            if since is not None and now - since > timeout:
                log.warning("aborting %s: its client read nothing for %.0f s", request.request_id, timeout)
                self.stats.num_slow_reader_aborts += 1
                self._notify("on_slow_reader_abort")
                self._fail_request(request, "abort", f"the client read nothing for {timeout:g} s")

    def _end_queue_timeouts(self) -> None:
        """End requests still waiting for admission past their deadline (finish_reason "timeout")."""
        deadlines = self._queue_deadlines
        now = time.monotonic()
        while deadlines and deadlines[0][0] < now:
            request = heapq.heappop(deadlines)[2]
            if request.request_id in self._requests and not request.was_admitted:
                waited = now - request.arrival_time
                log.warning("ending %s: it waited %.1f s in the queue, past its timeout", request.request_id, waited)
                self._notify("on_queue_timeout")
                self._fail_request(request, "timeout", f"the request waited {waited:.1f} s in the queue, past "
                                                       "its timeout, and was not started")  # fmt: skip

    def _count_prompt_tokens(self, seq: Sequence) -> None:
        """Each prompt position counts once per request: recomputing it after a preemption is not new work
        asked for, and positions found in the prefix cache at admission were never computed here."""
        request = seq.request
        computed = min(seq.num_computed_tokens, len(request.prompt_ids))
        if computed > request.num_prompt_tokens_computed:
            first_new = max(request.num_prompt_tokens_computed, request.num_cached_tokens)
            self.stats.num_prompt_tokens += max(0, computed - first_new)
            request.num_prompt_tokens_computed = computed

    def _fork_choices(self, seq: Sequence) -> list[Sequence]:
        """When a request with n > 1 finishes its prompt, its other choices fork from it here."""
        request = seq.request
        if seq.output_ids or len(request.sequences) == request.params.n:
            return [seq]
        children = []
        for index in range(len(request.sequences), request.params.n):
            child = Sequence(request, index, IncrementalDetokenizer(self.model.tokenizer, request.prompt_ids,
                                                                    request.params.skip_special_tokens),
                             seed_generator(request.params.seed, index))
            self.kv.fork(seq.seq_id, child.seq_id)
            child.num_computed_tokens = seq.num_computed_tokens
            request.sequences.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        return [seq, *children]

    def _drain_inbox(self) -> None:
        while True:
            with self._wakeup:
                if not self._inbox:
                    return
                command, payload = self._inbox.popleft()
            try:
                if command == "add":
                    self._add_request(payload)
                elif command == "abort" and payload in self._requests:
                    self._fail_request(self._requests[payload], "abort", None)
            except Exception as exc:  # it concerns this one request: end it, serve the others
                log.exception("engine failed to apply %r", command)
                request = payload if command == "add" else self._requests.get(payload)
                error = f"internal error in the engine: {type(exc).__name__}"
                if request is not None and request.request_id in self._requests:
                    self._fail_request(request, "error", error, latest_step_ran=False)
                elif request is not None and not request.stream.is_finished:
                    self._end_stream(request, "error", error)

    def _add_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        params = request.params
        seq = Sequence(request, 0, IncrementalDetokenizer(self.model.tokenizer, request.prompt_ids,
                                                          params.skip_special_tokens),
                       seed_generator(params.seed, 0))
        request.sequences.append(seq)
        self.scheduler.add(seq)
        if request.queue_deadline is not None:
            heapq.heappush(self._queue_deadlines, (request.queue_deadline, seq.seq_id, request))

    def _publish(self, seq: Sequence, output: RequestOutput) -> None:
        request = seq.request
        now = request.last_token_time or time.monotonic()
        if output.token_ids:
            self.stats.num_generation_tokens += 1
            if len(seq.output_ids) == 1 and seq.index == 0:
                self._notify("on_first_token", now - request.arrival_time)
        if request.prompt_logprobs is not None and seq.index == 0 and len(seq.output_ids) == 1:
            output.prompt_logprobs = request.prompt_logprobs
        if output.finish_reason is not None:
            self.scheduler.remove(seq)
            request.num_finished_choices += 1
        is_last = request.is_finished
        if is_last:
            output.usage = usage_of(request)
            self._finish_request(request, output.finish_reason or "stop")
        request.stream.put(output, is_last=is_last)

    def _fail_request(self, request: Request, reason: str, error: str | None, latest_step_ran: bool = True) -> None:
        """End every unfinished choice of a request (abort, engine error, shutdown).

        `latest_step_ran=False` when a step holding it failed: the KV that step was to write is
        never published to the prefix cache.
        """
        if request.request_id not in self._requests:
            return
        outputs = []
        for seq in request.sequences:
            if seq.finish_reason is None:
                if seq.status != SequenceStatus.FINISHED:
                    self.scheduler.remove(seq, latest_step_ran)
                outputs.append(finish_output(seq, reason, error=error, flush_text=False))
        # choices of n > 1 that were never forked (the prompt had not finished) end here too
        outputs += [RequestOutput(request.request_id, index, finish_reason=reason, error=error)
                    for index in range(len(request.sequences), request.params.n)]
        for output in outputs:
            request.num_finished_choices += 1
            is_last = request.is_finished
            if is_last:
                output.usage = usage_of(request)
                self._finish_request(request, reason)
            request.stream.put(output, is_last=is_last)

    def _fail_everything(self, error: str, include_inbox: bool = False) -> None:
        """After an error whose scope is unknown: end every request the engine holds with an error
        event and start the queues and the KV cache afresh (their state may be half-updated),
        publishing nothing. Requests still in the inbox were untouched and are served after, unless
        `include_inbox` (the thread is ending)."""
        requests = list(self._requests.values())
        if include_inbox:
            with self._wakeup:
                pending, self._inbox = list(self._inbox), deque()
            requests += [payload for command, payload in pending if command == "add"]
        for request in requests:
            try:
                self._end_stream(request, "error", error)
            except Exception:  # noqa: BLE001 - one stream must not keep the others open
                log.exception("could not end request %s", request.request_id)
        self._requests.clear()
        self._queue_deadlines.clear()
        self.num_running_requests = self.num_paused_requests = 0
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.kv.free_all(latest_step_ran=False)

    def _end_stream(self, request: Request, reason: str, error: str | None) -> None:
        """Put the last output of every choice not yet finished, without touching engine state."""
        finished = {seq.index for seq in request.sequences if seq.finish_reason is not None}
        unfinished = [i for i in range(request.params.n) if i not in finished]
        for position, index in enumerate(unfinished):
            is_last = position == len(unfinished) - 1
            output = RequestOutput(request.request_id, index, finish_reason=reason, error=error)
            if is_last:
                output.usage = usage_of(request)
                with self._wakeup:
                    self._num_unfinished -= 1
                self._notify("on_request_finished", request, reason)
            request.stream.put(output, is_last=is_last)

    def _finish_request(self, request: Request, reason: str) -> None:
        del self._requests[request.request_id]
        with self._wakeup:
            self._num_unfinished -= 1
        self._notify("on_request_finished", request, reason)

    def _notify(self, method: str, *args: Any) -> None:
        for observer in self.observers:
            hook = getattr(observer, method, None)  # an observer implements the hooks it wants
            if hook is None:
                continue
            try:
                hook(*args)
            except Exception:  # an observer must never take the engine down
                log.exception("engine observer %s.%s failed", type(observer).__name__, method)

    # ---- convenience for synchronous callers (CLI, benchmarks, tests) -------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, queue_timeout: float | None = None) -> list[RequestOutput]:
        """Submit and wait: the merged output of each choice."""
        merged: dict[int, RequestOutput] = {}
        for output in self.submit(prompt_ids, params, request_id, priority=priority, queue_timeout=queue_timeout):
            if output.index in merged:
                merged[output.index].merge(output)
            else:
                merged[output.index] = output
        return [merged[i] for i in sorted(merged)]

    @property
    def num_kv_blocks_used(self) -> int:
        return self.kv.num_used_blocks
