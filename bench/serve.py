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
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.serve_report import format_table, write_plot
from bench.serve_request import RequestResult, RequestSpec, send_request
from bench.serve_stats import DEFAULT_KNEE_FACTOR, KNEE_METRICS, LevelStats, find_knee

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
    parser.add_argument("--max-tokens", type=_positive_int, default=128,
                        help="output tokens per request (default %(default)s)")
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
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="per-request read timeout, s (default %(default)s)")
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
