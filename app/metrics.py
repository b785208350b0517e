"""Prometheus metrics at /metrics, one registry per app (several apps can live in one process).

Counters and histograms are fed by the engine's observer hooks on the engine thread (prometheus
values take a short lock, nothing else); gauges are read from the engine when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from decoding.engine.engine import Engine
from decoding.engine.outputs import FinishReason, RequestOutput
from decoding.engine.sequence import Request
from kvcache.prefix_tiers import TierCounters

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self._engine: Engine | None = None
        gauges = {
            "treadle_requests_running": ("Requests with a sequence in the running batch.", self._num_running),
            "treadle_requests_waiting": ("Admitted requests not yet running.", self._num_waiting),
            "treadle_requests_paused": ("Running requests not scheduled until their client reads its output.",
                                        lambda: self._engine.num_paused_requests if self._engine else 0),
            "treadle_kv_blocks_total": ("KV cache blocks.", lambda: self._engine.kv.num_total_blocks
                                        if self._engine else 0),
            "treadle_kv_blocks_used": ("KV cache blocks held by live sequences.",
                                       lambda: self._engine.kv.num_used_blocks if self._engine else 0),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(read)
        # process_resident_memory_bytes, process_open_fds, ...: leaks show up here in a soak
        ProcessCollector(registry=registry)
        registry.register(PrefixTierCollector(lambda: self._engine))
        self.prompt_tokens = Counter("treadle_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=registry)
        self.generation_tokens = Counter("treadle_generation_tokens", "Generated tokens of finished requests.",
                                         registry=registry)
        self.prefix_cache_hit_tokens = Counter("treadle_prefix_cache_hit_tokens",
                                               "Prompt tokens served from the prefix cache.", registry=registry)
        self.preemptions = Counter("treadle_preemptions", "Sequences preempted for KV blocks.", registry=registry)
        self.spec_draft_tokens = Counter("treadle_spec_draft_tokens",
                                         "Speculative draft tokens verified, of finished requests.", registry=registry)
        self.spec_accepted_tokens = Counter("treadle_spec_accepted_tokens",
                                            "Speculative draft tokens accepted, of finished requests.",
                                            registry=registry)
        self.slow_reader_aborts = Counter("treadle_slow_reader_aborts",
                                          "Requests aborted because their client read nothing for the timeout.",
                                          registry=registry)
        self.queue_timeouts = Counter("treadle_queue_timeouts",
                                      "Requests ended unstarted because they waited in the queue past their timeout.",
                                      registry=registry)
        self.request_success = Counter("treadle_request_success", "Finished requests by finish reason.",
                                       ["finish_reason"], registry=registry)
        self.requests_rejected = Counter("treadle_requests_rejected", "Requests refused with 429 (queue full).",
                                         registry=registry)
        self.requests_by_route = Counter("treadle_route_requests", "Generation requests submitted, by route (the "
                                         "OpenAI, Anthropic and Ollama APIs' paths).", ["route"], registry=registry)
        self.time_to_first_token = Histogram("treadle_time_to_first_token_seconds", "Arrival to first token.",
                                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("treadle_inter_token_latency_seconds",
                                             "Gap between consecutive tokens of a choice, as delivered.",
                                             buckets=_TOKEN_GAP_BUCKETS, registry=registry)
        self.e2e_request_latency = Histogram("treadle_e2e_request_latency_seconds", "Arrival to last token.",
                                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.step_seconds = Histogram("treadle_step_seconds", "One engine step (schedule, model, sample).",
                                      buckets=_TOKEN_GAP_BUCKETS, registry=registry)

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        engine.observers.append(EngineMetricsObserver(self))

    def _num_running(self) -> int:
        return self._engine.num_running_requests if self._engine else 0

    def _num_waiting(self) -> int:
        return self._engine.num_waiting_requests if self._engine else 0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixTierCollector:
    """The prefix cache per tier (`pool`, `ram`, `disk`), read from the engine when scraped."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self._engine = engine

    def describe(self) -> list[object]:
        return []  # collected only when scraped: the engine may not exist yet

    def collect(self) -> Iterator[object]:
        engine = self._engine()
        if engine is None:
            return
        kv = engine.kv
        tiers = kv.tiers
        block_bytes = engine.storage.spec.bytes_per_block
        rows: list[tuple[str, int, int, int, TierCounters]] = [  # tier, blocks, bytes, capacity, counters
            ("pool", kv.num_cached_blocks + kv.num_used_blocks, (kv.num_cached_blocks + kv.num_used_blocks)
             * block_bytes, kv.num_total_blocks * block_bytes,
             TierCounters(hits=kv.stats.num_pool_hit_blocks, evictions=kv.pool.num_evictions)),
        ]
        if tiers is not None:
            rows.append(("ram", len(tiers.host), tiers.host.num_bytes, tiers.settings.ram_bytes, tiers.counters("ram")))
            if tiers.disk is not None:
                rows.append(("disk", tiers.disk.num_blocks, tiers.disk.num_bytes, tiers.disk.max_bytes,
                             tiers.counters("disk")))
        gauges = {
            "blocks": ("Blocks held (the pool: used and cached).", 1),
            "bytes": ("Bytes held.", 2),
            "capacity_bytes": ("The tier's bound in bytes.", 3),
        }
        for name, (doc, column) in gauges.items():
            family = GaugeMetricFamily(f"treadle_prefix_cache_tier_{name}", doc, labels=["tier"])
            for row in rows:
                family.add_metric([row[0]], row[column])
            yield family
        counters = {
            "hits": "Blocks a prompt found in the tier (and did not compute).",
            "misses": "Lookups that reached the tier and found nothing.",
            "evictions": "Blocks pushed out of the tier for room.",
            "read_bytes": "Bytes copied out of the tier into the KV pool.",
            "written_bytes": "Bytes copied into the tier.",
            "copy_seconds": "Time spent copying blocks into and out of the tier (disk: reads and writes).",
        }
        fields = {"read_bytes": "bytes_read", "written_bytes": "bytes_written"}
        for name, doc in counters.items():
            family = CounterMetricFamily(f"treadle_prefix_cache_tier_{name}", doc, labels=["tier"])
            for tier, _, _, _, values in rows:
                family.add_metric([tier], getattr(values, fields.get(name, name)))
            yield family


class EngineMetricsObserver:
    """The engine's observer hooks → counters and histograms. Runs on the engine thread: no blocking."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def on_step(self, seconds: float, kernel_seconds: float, num_tokens: int, num_seqs: int) -> None:
        self.metrics.step_seconds.observe(seconds)

    def on_first_token(self, seconds: float) -> None:
        self.metrics.time_to_first_token.observe(seconds)

    def on_request_finished(self, request: Request, finish_reason: FinishReason) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(request.prompt_ids))
        m.generation_tokens.inc(request.num_completion_tokens)
        m.prefix_cache_hit_tokens.inc(request.num_cached_tokens)
        drafted, accepted = request.draft_token_counts
        m.spec_draft_tokens.inc(drafted)
        m.spec_accepted_tokens.inc(accepted)
        m.request_success.labels(finish_reason=finish_reason).inc()
        m.e2e_request_latency.observe(time.monotonic() - request.arrival_time)

    def on_preemption(self) -> None:
        self.metrics.preemptions.inc()

    def on_slow_reader_abort(self) -> None:
        self.metrics.slow_reader_aborts.inc()

    def on_queue_timeout(self) -> None:
        self.metrics.queue_timeouts.inc()


class TokenGapTimer:
    """Inter-token latency of one request as its reader receives tokens, per choice.

    Deltas that merged while the reader lagged carry several tokens; their gap is shared evenly.
    """

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._last_token_time: dict[int, float] = {}

    def observe(self, output: RequestOutput) -> None:
        num_tokens = len(output.token_ids)
        if not num_tokens:
            return
        now = time.monotonic()
        previous = self._last_token_time.get(output.index)
        self._last_token_time[output.index] = now
        if previous is None:
            return  # the wait for a choice's first token is time to first token, not a gap
        gap = (now - previous) / num_tokens
        for _ in range(num_tokens):
            self._histogram.observe(gap)
