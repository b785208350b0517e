"""`treadle bench serve`: a streaming load generator for any OpenAI-compatible server.

    treadle bench serve --base-url http://127.0.0.1:8000 --concurrency 1,4,16,32 --max-tokens 64 \\
        --json bench-results/serve.json --plot bench-results/serve.png

Modelled on vLLM's `bench serve`, with §5.3 of the load-testing guide we follow: raise concurrency
step by step, record P50/P95/P99 and throughput at each step, and find the knee where P99 turns up.

For each concurrency level C, `--requests` requests (default 2×C, at least 8) go to the server with
at most C in flight (a closed loop: a client sends its next request when its last one ends), all
with `stream: true`, over `/v1/completions` or, with `--chat`, `/v1/chat/completions`. Warm-up
requests run first and are not counted.

What is measured, per request, on the client's clock:
  * TTFT — from sending the request to the first chunk that carries text (a chat stream's opening
    role chunk has none, so it does not count; vLLM's own bench counts it);
  * ITL — the gaps between consecutive text-carrying chunks (a chunk that merges several tokens is
    one gap, as in vLLM's bench);
  * TPOT — (latency − TTFT) / (output tokens − 1), which merged chunks do not skew;
  * output tokens — `usage.completion_tokens` of the final chunk, asked for with
    `stream_options: {include_usage: true}`; a server that sends no usage is counted by its
    text-carrying chunks (one token each on llama.cpp's and llama-cpp-python's servers).

So that every request generates `--max-tokens`, the body carries `ignore_eos: true` (vLLM, treadle,
llama.cpp's llama-server) and `min_tokens: max_tokens` (vLLM, llama-cpp-python); lenient servers
ignore the one they do not know. A strict one (`transformers serve` answers 422 to unknown fields)
takes `--no-ignore-eos` and its own field through `--extra-body` (transformers: a `generation_config`
JSON string with `min_new_tokens`). Requests that still ended early are counted and reported.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.sse import aiter_sse_data

PERCENTILES = (50, 95, 99)
# A knee is a step up in concurrency where P99 grows this much faster than throughput does: past it,
# more concurrent clients buy latency instead of throughput (§5.3: "where P99 starts to climb steeply").
DEFAULT_KNEE_FACTOR = 1.5
KNEE_METRICS = ("ttft", "e2e", "itl", "tpot")

# Short common words, mostly one token each in BPE vocabularies, so L words make about L tokens.
_WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
          "from", "it", "an", "be", "this", "are", "or", "his", "her", "which", "one", "all", "were",
          "they", "had", "there", "not", "but", "have", "been", "more", "when", "who", "will", "would",
          "their", "can", "its", "into", "time", "only", "new", "some", "could", "these", "two", "may",
          "first", "then", "do", "any", "like", "other", "than", "now", "people", "my", "made", "over",
          "did", "down", "way", "find", "use", "long", "day", "get", "come", "made", "part", "sea", "air",
          "rain", "loom", "wheel", "thread", "yarn", "weave", "cloth", "wool", "spin", "mill", "town",
          "road", "river", "hill", "tree", "stone", "light", "sound", "word", "line", "page")


# ----------------------------------------------------------------------------------------------
# One request
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What every request of a run sends (the prompt aside)."""

    base_url: str
    model: str | None
    chat: bool
    max_tokens: int
    temperature: float
    ignore_eos: bool
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every body last (--extra-body)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")

    def body(self, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool = False
    error: str | None = None  # HTTP status ("429"), "stream_error", or the exception's name
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completion or chat chunk carries (choice 0; the usage chunk has no choices)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, prompt: str) -> RequestResult:
    result = RequestResult()
    started = time.perf_counter()
    last_token_at: float | None = None
    num_text_chunks = 0
    try:
        async with client.stream("POST", spec.url, json=spec.body(prompt), headers=spec.headers()) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = str(response.status_code)
                return result
            async for data in aiter_sse_data(response.aiter_bytes()):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = "stream_error"
                    return result
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.usage_reported = True
                if chunk_text(chunk):
                    now = time.perf_counter()
                    if last_token_at is None:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last_token_at)
                    last_token_at = now
                    num_text_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = type(exc).__name__
        return result
    finally:
        result.latency = time.perf_counter() - started
    if not result.usage_reported:
        result.output_tokens = num_text_chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no_output"
    return result


# ----------------------------------------------------------------------------------------------
# Statistics of one concurrency level
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Running levels
# ----------------------------------------------------------------------------------------------


def synthetic_prompt(num_tokens: int, rng: random.Random, index: int) -> str:
    """About `num_tokens` tokens of word salad; it opens with the request's index so that no two
    prompts share more than a token or two of prefix (prefix caches must not make it cheap)."""
    words = [f"Request {index}:"] + [rng.choice(_WORDS) for _ in range(max(0, num_tokens - 3))]
    return " ".join(words)


class Progress:
    """A tqdm bar on stderr when tqdm is installed and enabled; otherwise silent."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_level(client: httpx.AsyncClient, spec: RequestSpec, concurrency: int, prompts: list[str],
                    progress: Progress) -> LevelStats:
    """`prompts` as requests with at most `concurrency` in flight; duration from first send to last end."""
    pending = iter(prompts)
    results: list[RequestResult] = []

    async def client_loop() -> None:
        for prompt in pending:  # one shared iterator: each prompt is taken by exactly one loop
            results.append(await send_request(client, spec, prompt))
            progress.update()

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return LevelStats.of(concurrency, results, time.perf_counter() - started, spec.max_tokens)


async def discover_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str | None:
    """The first model of GET /v1/models (vLLM needs `model` in every request); None if none is listed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        data = response.json().get("data") or []
        return str(data[0]["id"]) if response.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


@dataclass(slots=True)
class BenchConfig:
    base_url: str
    model: str | None
    chat: bool
    concurrency: list[int]
    requests: int | None  # per level; None: 2 × concurrency, at least 8
    max_tokens: int
    prompt_tokens: int
    temperature: float
    ignore_eos: bool
    warmup: int
    seed: int
    timeout_s: float
    knee_metric: str
    knee_factor: float
    api_key: str | None = None
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def num_requests(self, concurrency: int) -> int:
        return max(self.requests, concurrency) if self.requests else max(8, 2 * concurrency)


async def run_bench(config: BenchConfig) -> dict[str, Any]:
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    limits = httpx.Limits(max_connections=max(config.concurrency), max_keepalive_connections=max(config.concurrency))
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = config.model or await discover_model(client, config.base_url, config.api_key)
        spec = RequestSpec(config.base_url, model, config.chat, config.max_tokens, config.temperature,
                           config.ignore_eos, config.api_key, config.extra_body)
        rng = random.Random(config.seed)
        total = config.warmup + sum(config.num_requests(c) for c in config.concurrency)
        progress = Progress(total, config.progress)
        levels: list[LevelStats] = []
        index = 0
        try:
            # Warm-up: the server's first requests may pay for compilation, allocation or page faults.
            progress.describe("warm-up")
            warm = [synthetic_prompt(config.prompt_tokens, rng, index + i) for i in range(config.warmup)]
            index += config.warmup
            warm_stats = await run_level(client, spec, max(1, config.warmup), warm, progress) if warm else None
            if warm_stats is not None and warm_stats.num_completed == 0:
                raise RuntimeError(f"every warm-up request failed: {warm_stats.errors}")
            for concurrency in config.concurrency:
                progress.describe(f"concurrency {concurrency}")
                count = config.num_requests(concurrency)
                prompts = [synthetic_prompt(config.prompt_tokens, rng, index + i) for i in range(count)]
                index += count
                levels.append(await run_level(client, spec, concurrency, prompts, progress))
        finally:
            progress.close()
    knee = find_knee(levels, config.knee_metric, config.knee_factor)
    return {
        "base_url": config.base_url,
        "model": model,
        "endpoint": spec.url.removeprefix(config.base_url.rstrip("/")),
        "config": {k: v for k, v in asdict(config).items() if k not in ("api_key", "progress")},
        "machine": machine_description(),
        "started_at": started_at,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [asdict(level) for level in levels],
        "knee": asdict(knee),
    }


def machine_description() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "os": platform.platform()}


# ----------------------------------------------------------------------------------------------
# Report: table, JSON, plot
# ----------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def format_table(report: dict[str, Any]) -> str:
    header = ("conc", "reqs", "ok", "req/s", "out tok/s", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99",
              "TPOT p50", "errors")
    rows = [header]
    for lv in report["levels"]:
        ttft, itl, tpot = lv["ttft_ms"], lv["itl_ms"], lv["tpot_ms"]
        errors = ", ".join(f"{k}×{v}" for k, v in sorted(lv["errors"].items())) or "-"
        rows.append((str(lv["concurrency"]), str(lv["num_requests"]), str(lv["num_completed"]),
                     _fmt(lv["request_throughput"], 2), _fmt(lv["output_throughput"]),
                     _fmt(ttft["p50"]), _fmt(ttft["p95"]), _fmt(ttft["p99"]),
                     _fmt(itl["p50"]), _fmt(itl["p95"]), _fmt(itl["p99"]), _fmt(tpot["p50"]), errors))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    knee = report["knee"]
    if knee["concurrency"] is None:
        lines.append(f"knee: none among these levels (P99 {knee['metric']} never grew {knee['threshold']}× faster "
                     f"than throughput)")
    else:
        lines.append(f"knee: concurrency {knee['concurrency']} (P99 {knee['metric']} grew {knee['factor']:.1f}× "
                     f"faster than throughput going to {knee['next_concurrency']})")
    short = [f"{lv['num_short']} at concurrency {lv['concurrency']}" for lv in report["levels"] if lv["num_short"]]
    if short:
        lines.append(f"note: requests that ended before max_tokens ({', '.join(short)}): the server ignored "
                     f"ignore_eos/min_tokens or cut the stream")
    counted = [str(lv["concurrency"]) for lv in report["levels"] if lv["usage_source"] not in ("server", "none")]
    if counted:
        lines.append(f"note: no usage from the server (concurrency {', '.join(counted)}): output tokens counted "
                     f"as text-carrying chunks")
    lines.append("times in ms; ITL per text chunk, TPOT per output token")
    return "\n".join(lines)


def write_plot(runs: dict[str, dict[str, Any]], path: str | Path, title: str | None = None) -> None:
    """One figure: P50/P99 TTFT and ITL against concurrency (left), output tokens/s (right); each
    run's knee marked. `runs` maps a label (a server's name) to its report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from exc

    from matplotlib.lines import Line2D

    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    show_p50 = len(runs) == 1  # with several servers, p50 lines would bury the p99s
    for i, (label, report) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        levels = sorted(report["levels"], key=lambda lv: lv["concurrency"])
        xs = [lv["concurrency"] for lv in levels]
        for metric, style in (("ttft_ms", "-"), ("itl_ms", ":")):
            ax_lat.plot(xs, [lv[metric]["p99"] for lv in levels], style, marker="o", color=color)
            if show_p50:
                ax_lat.plot(xs, [lv[metric]["p50"] for lv in levels], style, marker=".", color=color, alpha=0.4)
        ax_tput.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", color=color, label=label)
        knee = report["knee"]
        if knee["concurrency"] is not None:
            for ax in (ax_lat, ax_tput):
                ax.axvline(knee["concurrency"], color=color, linestyle="--", alpha=0.5)
            ax_tput.annotate(f"knee ({label})" if len(runs) > 1 else "knee", (knee["concurrency"], 0),
                             xycoords=("data", "axes fraction"), xytext=(3, 4 + 11 * i), textcoords="offset points",
                             color=color, fontsize=8)
    styles = [Line2D([], [], color="0.3", linestyle="-", marker="o", label="TTFT p99"),
              Line2D([], [], color="0.3", linestyle=":", marker="o", label="ITL p99")]
    if show_p50:
        styles += [Line2D([], [], color="0.3", alpha=0.4, linestyle="-", marker=".", label="TTFT p50"),
                   Line2D([], [], color="0.3", alpha=0.4, linestyle=":", marker=".", label="ITL p50")]
    ax_lat.legend(handles=styles, fontsize=8, loc="upper left")
    all_levels = sorted({lv["concurrency"] for report in runs.values() for lv in report["levels"]})
    for ax in (ax_lat, ax_tput):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_levels, [str(c) for c in all_levels])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("concurrent streams")
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (ms, log)")
    ax_lat.set_title("TTFT and inter-token latency (ITL)")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_title("output throughput, all streams")
    ax_tput.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be at least 1, got {text!r}")
    return levels


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    parser.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--concurrency", type=_levels, default=[1, 4, 16, 32],
                        help="comma-separated levels of requests in flight (default 1,4,16,32)")
    parser.add_argument("--requests", type=_positive_int, help="requests per level (default 2×concurrency, ≥ 8)")
    parser.add_argument("--max-tokens", type=_positive_int, default=128, help="output tokens per request (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=_positive_int, default=128,
                        help="approximate prompt length in tokens, synthetic text (default %(default)s)")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default %(default)s)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos/min_tokens (requests may end before --max-tokens)")
    parser.add_argument("--extra-body", type=_json_object, default={},
                        help="JSON object merged into every request body, e.g. a server's own way to force the "
                             "output length: '{\"generation_config\": \"{\\\"min_new_tokens\\\": 64}\"}'")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted warm-up requests first (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s (default %(default)s)")
    parser.add_argument("--knee-metric", choices=KNEE_METRICS, default="ttft",
                        help="whose P99 finds the knee (default %(default)s)")
    parser.add_argument("--knee-factor", type=float, default=DEFAULT_KNEE_FACTOR,
                        help="P99 growth / throughput growth that marks a knee (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY)")
    parser.add_argument("--json", dest="json_path", help="write the full report as JSON here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG of latency and throughput against concurrency")
    parser.add_argument("--label", help="name of the server in the plot and JSON (default: the model)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    config = BenchConfig(base_url=args.base_url, model=args.model, chat=args.chat, concurrency=args.concurrency,
                         requests=args.requests, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                         temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=max(0, args.warmup),
                         seed=args.seed, timeout_s=args.timeout, knee_metric=args.knee_metric,
                         knee_factor=args.knee_factor, api_key=args.api_key, progress=args.progress,
                         extra_body=args.extra_body)
    try:
        report = asyncio.run(run_bench(config))
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"treadle bench serve: error: {exc}", file=sys.stderr)
        return 1
    report["label"] = args.label or report["model"] or config.base_url
    print(f"{report['label']} at {config.base_url}{report['endpoint']}: prompts ~{config.prompt_tokens} tokens, "
          f"max_tokens {config.max_tokens}, ignore_eos {config.ignore_eos}")
    print(format_table(report))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot_path:
        write_plot({report["label"]: report}, args.plot_path, title=f"{report['label']} — {config.base_url}")
    failed = all(lv["num_completed"] == 0 for lv in report["levels"])
    return 1 if failed else 0
