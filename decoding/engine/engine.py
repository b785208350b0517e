"""The engine: one thread turning the loop, each step a few stages with typed hand-offs.

    Scheduler.schedule() → ScheduledStep → ModelRunner.forward → logits → sample_step → StepResult
        → OutputProcessor.process (publish) → Scheduler.update_from_output

`Engine` keeps what is no stage's: the inbox, the thread, the queue deadlines and fatal failure.

`submit()` and `abort()` may be called from any thread or from the asyncio loop: they only put
commands in a bounded inbox (decoding.engine.inbox). The engine thread owns all engine state and
applies the inbox before anything else in every step. It is the pool's thread 0, so it takes part
in every model step, and it parks on a condition while there is nothing to do: an idle server burns
no CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from threadpool import BrokenPool, SpinPool

from ..kernels import weight_cache
from ..kernels.forward import KernelWeights, int8_kernels, resident_weight_bytes
from ..model.decoder_embedder import DecoderEmbedder
from ..model.model import Model
from . import memory
from .config import KV_CACHE_DTYPES, EngineConfig, resolve_kv_cache_dtype
from .embedding import EncodeRequest
from .embedding_lane import EmbeddingLane, SharedEmbeddingEngine
from .errors import EngineFailed, EngineShuttingDown, QueueFull, RequestTooLarge
from .inbox import Inbox
from .key_calibration import centre_keys
from .kv_setup import build_kv_cache, key_centres_cache, kv_cache_spec
from .observers import EngineObserver, EngineStats, notify
from .output_processor import OutputProcessor
from .outputs import FinishReason, RequestOutput, RequestStream
from .params import InvalidParams, SamplingParams
from .runner import ModelRunner
from .sampling import Sampler
from .scheduler import Scheduler
from .sequence import Request
from .step import ScheduledStep, StepResult
from .step_batch import build_step_batch
from .step_sampling import sample_step
from .structured import Guide
from .validation import validate_constraints, validate_request

# The engine's configuration and refusals travel with it: `from decoding.engine.engine import ...`.
__all__ = ["KV_CACHE_DTYPES", "Engine", "EngineConfig", "EngineFailed", "EngineObserver", "EngineShuttingDown",
           "EngineStats", "QueueFull", "RequestTooLarge", "resolve_kv_cache_dtype"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Model, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = cfg = config or EngineConfig()
        self.max_model_len = min(cfg.max_model_len or model.config.max_context, model.config.max_context)
        mc = model.config
        spec = kv_cache_spec(model, cfg)
        weights_bytes = resident_weight_bytes(model.weights, fast=int8_kernels(cfg.kernels))
        num_blocks = memory.num_kv_blocks(cfg, spec, weights_bytes, self.max_model_len)
        prefix_ram_bytes = memory.prefix_ram_bytes(cfg, weights_bytes, num_blocks * spec.bytes_per_block)
        # Repacking holds one matrix's file pages beside its copy until the pages are released: done
        # before the KV cache is touched, that passing peak does not stack on the cache's.
        cache = weight_cache.cache_file(model.path) if cfg.weight_cache and model.path.is_file() else None
        weights = KernelWeights.build(mc, model.weights, fast=int8_kernels(cfg.kernels), cache=cache)
        self.storage, self.kv = build_kv_cache(model, cfg, spec, num_blocks, self.max_model_len, prefix_ram_bytes)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_itl_stretch,
                                   cfg.speculative, cfg.speculative_max_tokens, cfg.priority_starvation_seconds)
        self.pool = SpinPool(cfg.n_threads, pin=cfg.pin_threads)
        max_logit_rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.runner = ModelRunner(model, self.storage, self.pool, cfg.max_num_batched_tokens, max_logit_rows,
                                  cfg.kernels, weights)
        if spec.dtype == "int8":
            centre_keys(self.runner, model.tokenizer, key_centres_cache(model, cfg, spec, self.kv))
        self.sampler = Sampler(mc.vocab_size, self.pool, mc.eos_token_ids)  # EOS is masked before min_tokens
        self.guide = Guide.for_model(model)  # structured output; llguidance loads on the first constraint
        self.stats = EngineStats()
        self.observers: list[EngineObserver] = []
        self.fault_hook: Callable[[ScheduledStep], None] | None = None  # tests inject step failures here
        self.inbox = Inbox(cfg.max_queue)
        self.outputs = OutputProcessor(model.tokenizer, self.guide, mc.eos_token_ids, self.max_model_len, self.stats,
                                       self.observers, on_request_done=self.inbox.request_done)  # engine thread only
        self._queue_deadlines: list[tuple[float, int, Request]] = []  # a heap; engine thread only
        self.num_running_requests = 0  # requests with a sequence in the running queue, after the last step
        self.num_paused_requests = 0  # of those, requests waiting for their client to read
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def serve_embeddings(self, embedder: DecoderEmbedder) -> SharedEmbeddingEngine:
        """Embed with this engine's model too (`--task generate,embed`), before `start`: the inputs share
        the generation's steps (decoding.engine.embedding_lane). Returns the embedding engine's interface."""
        if embedder.decoder is not self.model:
            raise ValueError("the embedder must pool this engine's model")
        if self._thread is not None:
            raise RuntimeError("serve_embeddings comes before start()")
        lane = EmbeddingLane(self.kv, embedder, self.config.max_num_seqs,
                             on_request_done=lambda _: self.inbox.request_done())  # fmt: skip
        self.scheduler.embedding_lane = lane
        return SharedEmbeddingEngine(self, embedder, min(self.max_model_len, embedder.config.max_context))

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
        stream = RequestStream(request_id, loop, self.config.max_unread_bytes, on_drained=self.inbox.wake)
        request = Request(request_id, list(prompt_ids), params, stream, priority=priority)
        if queue_timeout is not None:
            request.queue_deadline = request.arrival_time + queue_timeout
        self.inbox.put("add", request, new_request=True)
        return stream

    def submit_embedding(self, request: EncodeRequest) -> None:
        """Queue an embedding request (SharedEmbeddingEngine.submit validated it); its future gets the result."""
        if self.scheduler.embedding_lane is None:
            raise RuntimeError("this engine serves no embeddings: see serve_embeddings")
        self.inbox.put("embed", request, new_request=True)

    def abort(self, request_id: str) -> None:
        self.inbox.put("abort", request_id)

    def clear_prefix_cache(self, timeout: float = 60.0) -> dict[str, int]:
        """Forget every cached prefix (the KV pool's, host memory's and the disk's), between two steps;
        returns the blocks each dropped."""
        done: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()
        if self.inbox.stopping:
            raise EngineShuttingDown("the engine is not running")
        self.inbox.put("clear_prefix_cache", done)
        return done.result(timeout)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestTooLarge` or `InvalidParams` for what could never be served."""
        validate_request(prompt_ids, params, self.model.config.vocab_size, self.max_model_len,
                         self.config.max_num_seqs, self.kv)
        validate_constraints(params, self.guide)

    @property
    def num_unfinished(self) -> int:
        return self.inbox.num_unfinished

    @property
    def failure(self) -> str | None:
        """Why the engine thread ended, if it did on an error."""
        return self.inbox.failure

    @property
    def num_waiting_requests(self) -> int:
        """Generation requests submitted and not yet running: in the inbox, or waiting for admission (or
        preempted). Embedding requests are not counted."""
        lane = self.scheduler.embedding_lane
        return max(0, self.inbox.num_unfinished - self.num_running_requests - (lane.num_requests if lane else 0))

    def shutdown(self) -> None:
        self.inbox.stop()
        if self._thread is not None:
            self._thread.join()
        self.pool.close()

    # ---- engine thread ----------------------------------------------------------------------------

    @property
    def is_failed(self) -> bool:
        """The engine thread ended on an error (or died): nothing it holds will ever finish."""
        return self.failure is not None or (self._thread is not None and not self._thread.is_alive()
                                            and not self.inbox.stopping)

    def _loop(self) -> None:
        failure: BaseException | None = None
        try:
            while self.inbox.wait_for_work(lambda: self.scheduler.has_work, self.PAUSED_RECHECK_SECONDS):
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

    def _close(self, failure: BaseException | None) -> None:
        """The thread's last act: end every request it holds or will never take from the inbox."""
        if failure is not None:
            log.critical("the engine thread died: %s: %s", type(failure).__name__, failure)
            self.inbox.stop(failure=f"{type(failure).__name__}: {failure}")
            self._fail_everything(f"the engine failed: {type(failure).__name__}", include_inbox=True)
            return
        self._drain_inbox()
        for request in list(self.outputs.requests.values()):
            self._end_request(request, FinishReason.ABORT_SHUTDOWN)
        if self.scheduler.embedding_lane is not None:
            self.scheduler.embedding_lane.end_all(EngineShuttingDown("the engine shut down before the request "
                                                                     "finished"))  # fmt: skip
        self.kv.close_tiers()

    def step(self) -> None:
        """One turn: apply the inbox and the deadlines, then the step's stages."""
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
        self.inbox.mark_idle()
        step = self.scheduler.schedule()
        for _ in step.preempted:
            self._notify("on_preemption")
        if step.preempted:
            self.inbox.is_idle = False  # it admits nothing right after preempting: the next step will
        if step.is_empty:
            return
        self.inbox.is_idle = False
        started = time.perf_counter()
        try:
            result, kernel_seconds = self._run_stages(step)
        except Exception as exc:  # a failed step ends only the requests it touched
            log.exception("engine step failed")
            for request in {id(c.seq.request): c.seq.request for c in step.chunks}.values():
                self._end_request(request, FinishReason.ERROR, f"internal error while generating: {type(exc).__name__}",
                                  latest_step_ran=False)
            if step.embeddings:
                self.scheduler.embedding_lane.abandon(  # type: ignore[union-attr]
                    step.embeddings, EngineFailed(f"internal error while embedding: {type(exc).__name__}"))
            if isinstance(exc, BrokenPool):
                raise
            return
        self._record_step(step, result, time.perf_counter() - started, kernel_seconds)

    def _run_stages(self, step: ScheduledStep) -> tuple[StepResult, float]:
        """The model step, sampling, publishing and the scheduler's update; returns the result and the
        seconds the kernels took."""
        if self.fault_hook is not None:
            self.fault_hook(step)
        batch, first_rows = build_step_batch(self.kv, step)
        kernel_started = time.perf_counter()
        logits = self.runner.forward(batch)
        kernel_seconds = time.perf_counter() - kernel_started
        if step.embeddings:
            self.scheduler.embedding_lane.finish(step.embeddings, self.runner.pooled_rows(batch))  # type: ignore[union-attr]
        result = sample_step(step, logits, first_rows, self.sampler, self.guide)
        finished = self.outputs.process(step, result)
        self.stats.num_prompt_tokens += self.scheduler.update_from_output(step, result, finished)
        return result, kernel_seconds

    def _record_step(self, step: ScheduledStep, result: StepResult, seconds: float, kernel_seconds: float) -> None:
        self.scheduler.observe_step(step, seconds)
        self.stats.num_steps += 1
        self.stats.step_seconds += seconds
        self.stats.kernel_seconds += kernel_seconds
        self.stats.num_draft_tokens += step.num_draft_tokens
        self.stats.num_accepted_draft_tokens += sum(r.num_accepted_drafts for r in result.chunks)
        self._notify("on_step", seconds, kernel_seconds, step.num_tokens + step.num_embedding_tokens,
                     len(step.chunks) + len(step.embeddings))
        self._notify("on_step_scheduled", step, seconds, kernel_seconds)

    def _abort_slow_readers(self) -> None:
        """End requests whose client has read nothing for the timeout while the engine waited on it."""
        if not self.num_paused_requests:  # counted after the last step; a pause is timed in seconds
            return
        timeout = self.config.slow_reader_timeout_seconds
        now = time.monotonic()
        for request in list(self.outputs.requests.values()):
            since = request.stream.backlogged_since
            if since is not None and now - since > timeout:
                log.warning("aborting %s: its client read nothing for %.0f s", request.request_id, timeout)
                self.stats.num_slow_reader_aborts += 1
                self._notify("on_slow_reader_abort")
                self._end_request(request, FinishReason.ABORT_CLIENT, f"the client read nothing for {timeout:g} s")

    def _end_queue_timeouts(self) -> None:
        """End requests still waiting for admission past their deadline (finish_reason "timeout")."""
        deadlines = self._queue_deadlines
        now = time.monotonic()
        while deadlines and deadlines[0][0] < now:
            request = heapq.heappop(deadlines)[2]
            if request.request_id in self.outputs.requests and not request.was_admitted:
                waited = now - request.arrival_time
                log.warning("ending %s: it waited %.1f s in the queue, past its timeout", request.request_id, waited)
                self._notify("on_queue_timeout")
                self._end_request(request, FinishReason.TIMEOUT, f"the request waited {waited:.1f} s in the queue, "
                                                                 "past its timeout, and was not started")  # fmt: skip

    def _drain_inbox(self) -> None:
        while (taken := self.inbox.take()) is not None:
            command, payload = taken
            try:
                if command == "add":
                    self._add_request(payload)
                elif command == "embed":
                    self.scheduler.embedding_lane.add(payload)  # type: ignore[union-attr]
                elif command == "abort" and payload in self.outputs.requests:
                    self._end_request(self.outputs.requests[payload], FinishReason.ABORT_CLIENT)
                elif command == "clear_prefix_cache":
                    payload.set_result(self.kv.clear_prefix_cache())
            except Exception as exc:  # it concerns this one request: end it, serve the others
                log.exception("engine failed to apply %r", command)
                if isinstance(payload, concurrent.futures.Future):
                    payload.set_exception(exc)
                    continue
                if isinstance(payload, EncodeRequest):
                    self.inbox.request_done()
                    payload.resolve(EngineFailed(f"internal error in the engine: {type(exc).__name__}"))
                    continue
                request = payload if command == "add" else self.outputs.requests.get(payload)
                error = f"internal error in the engine: {type(exc).__name__}"
                if request is not None and request.request_id in self.outputs.requests:
                    self._end_request(request, FinishReason.ERROR, error, latest_step_ran=False)
                elif request is not None and not request.stream.is_finished:
                    self.outputs.end_stream(request, error)

    def _add_request(self, request: Request) -> None:
        seq = self.outputs.add(request)
        self.scheduler.add(seq)
        if request.queue_deadline is not None:
            heapq.heappush(self._queue_deadlines, (request.queue_deadline, seq.seq_id, request))

    def _end_request(self, request: Request, reason: FinishReason, error: str | None = None,
                     latest_step_ran: bool = True) -> None:  # fmt: skip
        """End a request outside a step's natural course (abort, timeout, error, shutdown) and free its
        sequences. `latest_step_ran=False` when a step holding it failed: the KV that step was to
        write is never published to the prefix cache."""
        for seq in self.outputs.end_request(request, reason, error):
            self.scheduler.remove(seq, latest_step_ran)

    def _fail_everything(self, error: str, include_inbox: bool = False) -> None:
        """After an error whose scope is unknown: end every request the engine holds with an error
        event and start the queues and the KV cache afresh (their state may be half-updated),
        publishing nothing. Requests still in the inbox were untouched and are served after, unless
        `include_inbox` (the thread is ending)."""
        requests = list(self.outputs.requests.values())
        if include_inbox:
            pending = self.inbox.take_all()
            requests += [payload for command, payload in pending if command == "add"]
            for _, payload in pending:
                if isinstance(payload, concurrent.futures.Future):
                    payload.set_exception(EngineFailed(error))
                elif isinstance(payload, EncodeRequest):
                    self.inbox.request_done()
                    payload.resolve(EngineFailed(error))
        for request in requests:
            try:
                self.outputs.end_stream(request, error)
            except Exception:  # noqa: BLE001 - one stream must not keep the others open
                log.exception("could not end request %s", request.request_id)
        self.outputs.requests.clear()
        self._queue_deadlines.clear()
        self.num_running_requests = self.num_paused_requests = 0
        if self.scheduler.embedding_lane is not None:  # before free_all: the lane frees its inputs' blocks
            self.scheduler.embedding_lane.end_all(EngineFailed(error))
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.kv.free_all(latest_step_ran=False)

    def _notify(self, method: str, *args: Any) -> None:
        notify(self.observers, method, *args)

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
