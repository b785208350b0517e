"""`treadle bench serve`'s statistics of one concurrency level (percentiles of TTFT, ITL, TPOT and
end-to-end latency, throughput, errors) and the knee rule that finds where P99 turns up."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.serve_request import RequestResult

PERCENTILES = (50, 95, 99)
# A knee is a step up in concurrency where P99 grows this much faster than throughput does: past it,
# more concurrent clients buy latency instead of throughput (§5.3: "where P99 starts to climb steeply").
DEFAULT_KNEE_FACTOR = 1.5
KNEE_METRICS = ("ttft", "e2e", "itl", "tpot")


@dataclass(slots=True)
class Distribution:
    """Milliseconds: mean and the percentiles in PERCENTILES (linear interpolation, as numpy and vLLM)."""

    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution:
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p95, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(mean=float(ms.mean()), p50=p50, p95=p95, p99=p99)


@dataclass(slots=True)
class LevelStats:
    concurrency: int
    num_requests: int
    num_completed: int
    num_short: int  # completed with fewer than max_tokens output tokens
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s, all streams together
    total_output_tokens: int
    mean_prompt_tokens: float | None  # as the server counted them, where it reported usage
    usage_source: str  # "server", "chunks" (no usage reported) or "mixed"
    errors: dict[str, int]
    ttft_ms: Distribution
    itl_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution

    @classmethod
    def of(cls, concurrency: int, results: list[RequestResult], duration_s: float, max_tokens: int) -> LevelStats:
        done = [r for r in results if r.ok]
        total_tokens = sum(r.output_tokens for r in done)
        with_usage = [r for r in done if r.usage_reported]
        prompt_counts = [r.prompt_tokens for r in with_usage if r.prompt_tokens is not None]
        source = "server" if len(with_usage) == len(done) else "chunks" if not with_usage else "mixed"
        return cls(
            concurrency=concurrency, num_requests=len(results), num_completed=len(done),
            num_short=sum(r.output_tokens < max_tokens for r in done), duration_s=duration_s,
            request_throughput=len(done) / duration_s if duration_s > 0 else 0.0,
            output_throughput=total_tokens / duration_s if duration_s > 0 else 0.0,
            total_output_tokens=total_tokens,
            mean_prompt_tokens=float(np.mean(prompt_counts)) if prompt_counts else None,
            usage_source=source if done else "none",
            errors=dict(Counter(r.error for r in results if r.error is not None)),
            ttft_ms=Distribution.of([r.ttft for r in done if r.ttft is not None]),
            itl_ms=Distribution.of([gap for r in done for gap in r.itls]),
            tpot_ms=Distribution.of([t for r in done if (t := r.tpot) is not None]),
            e2e_ms=Distribution.of([r.latency for r in done]),
        )

    def p99(self, metric: str) -> float | None:
        dist: Distribution = getattr(self, f"{metric}_ms")
        return dist.p99


@dataclass(frozen=True, slots=True)
class Knee:
    concurrency: int | None  # the last level before P99 turns up; None: no knee among the levels run
    next_concurrency: int | None  # the level where it turned up
    metric: str
    factor: float  # (P99 growth / throughput growth) at that step
    threshold: float


def find_knee(levels: Sequence[LevelStats], metric: str = "ttft", threshold: float = DEFAULT_KNEE_FACTOR) -> Knee:
    """The first step up in concurrency where P99 of `metric` grows `threshold` times faster than output
    throughput: (p99[i+1] / p99[i]) / (tput[i+1] / tput[i]) > threshold. The knee is level i.

    While throughput scales with concurrency, a rising P99 is the price of batching, not a knee; once
    throughput stops scaling, P99 climbs with the queue (§5.3).
    """
    ordered = sorted((lv for lv in levels if lv.p99(metric) and lv.output_throughput > 0),
                     key=lambda lv: lv.concurrency)
    for lower, upper in itertools.pairwise(ordered):
        lower_p99, upper_p99 = lower.p99(metric), upper.p99(metric)
        assert lower_p99 is not None and upper_p99 is not None
        factor = (upper_p99 / lower_p99) / (upper.output_throughput / lower.output_throughput)
        if factor > threshold:
            return Knee(lower.concurrency, upper.concurrency, metric, factor, threshold)
    return Knee(None, None, metric, 0.0, threshold)
