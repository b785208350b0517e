"""`treadle bench soak`: many streaming clients against a running server for a long while — some
leave mid-stream, a few send garbage — then check that nothing failed and nothing leaked.

    treadle serve &
    treadle bench soak --duration 600 --clients 64 --disconnect-rate 0.2 --json soak.json

Each client loops until the time is up: a chat or completion request with a random prompt length,
`max_tokens`, temperature, `n`, stop strings and usage option, streamed as SSE (one in ten not
streamed); with probability `--disconnect-rate` it leaves at a random point (before the first token,
or after a random number of events); with probability `--malformed-rate` it sends a malformed body
instead. A prober times `GET /health` throughout; /metrics is sampled for the KV cache, the queues,
the server's resident memory (process_resident_memory_bytes) and its open file descriptors.

When the time is up the clients finish what they are doing, the server is left to come to rest, and
these checks decide the exit status (1 if any fails):

- no 5xx, no error event in a stream, no failed connection;
- every malformed request answered 4xx;
- every stream read to its end well formed: each choice once with a `finish_reason` (`stop` or
  `length`) and nothing after it, chunks of the right object type, `[DONE]` last, usage only when asked;
- at rest: `treadle_kv_blocks_used` 0, no request running or waiting, open fds back to where they were;
- resident memory grew by at most `--max-rss-growth-mib` after the warm-up (the first tenth of the run),
  net of the prefix cache's host-memory tier (`--prefix-cache-ram-mb`: KV blocks kept by design, up to
  its own bound, filling as fast as the traffic evicts them);
- `/health` p99 latency under `--max-health-p99-ms` (the event loop was never starved).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.prometheus import parse_metrics
from bench.soak_clients import SoakClient, SoakConfig, SoakStats

SETTLE_SECONDS = 60.0  # how long the server may take to come to rest once traffic stops
FD_SLACK = 8  # descriptors the server may legitimately hold more at rest (its own files, a log)


# ---- probes ---------------------------------------------------------------------------------------


_WATCHED = {"rss": "process_resident_memory_bytes", "fds": "process_open_fds", "kv_used": "treadle_kv_blocks_used",
            "kv_total": "treadle_kv_blocks_total", "running": "treadle_requests_running",
            "waiting": "treadle_requests_waiting", "preemptions": "treadle_preemptions_total",
            "aborted": 'treadle_request_success_total{finish_reason="abort_client"}',
            "failed": 'treadle_request_success_total{finish_reason="error"}',
            "ram_tier": 'treadle_prefix_cache_tier_bytes{tier="ram"}'}


async def sample_metrics(http: httpx.AsyncClient, started: float) -> dict[str, float]:
    response = await http.get("/metrics")
    response.raise_for_status()
    samples = parse_metrics(response.text)
    return {"t": time.monotonic() - started, **{k: samples.get(name, 0.0) for k, name in _WATCHED.items()}}


async def probe_health(http: httpx.AsyncClient, stats: SoakStats, interval: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        try:
            response = await http.get("/health")
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        stats.health_ms.append((time.perf_counter() - began) * 1000)
        stats.num_health_failures += not ok
        await asyncio.sleep(interval)


async def probe_metrics(http: httpx.AsyncClient, stats: SoakStats, interval: float, started: float,
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            stats.samples.append(await sample_metrics(http, started))
        except httpx.HTTPError as exc:
            stats.problem(f"/metrics failed: {exc}")
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


async def settle(http: httpx.AsyncClient, started: float) -> dict[str, float]:
    """/metrics once the server is at rest (KV free, nothing running), or after SETTLE_SECONDS."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        sample = await sample_metrics(http, started)
        at_rest = sample["kv_used"] == 0 and sample["running"] == 0 and sample["waiting"] == 0
        if at_rest or time.monotonic() > deadline:
            return sample
        await asyncio.sleep(0.2)


# ---- the run --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def soak(cfg: SoakConfig) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(connect=30, read=cfg.finish_timeout, write=30, pool=cfg.finish_timeout)
    limits = httpx.Limits(max_connections=cfg.clients, max_keepalive_connections=cfg.clients)
    stats = SoakStats()
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=10) as probe:
        health = await probe.get("/health")
        if health.status_code != 200:
            raise SystemExit(f"treadle bench soak: {cfg.base_url}/health answers {health.status_code}; "
                             "start the server (and let it warm up) first")
        before = await settle(probe, started)
        stop_probes = asyncio.Event()
        probes = [asyncio.create_task(probe_health(probe, stats, cfg.health_interval, stop_probes)),
                  asyncio.create_task(probe_metrics(probe, stats, cfg.metrics_interval, started, stop_probes))]
        async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=timeout, limits=limits) as http:
            client = SoakClient(cfg, http, stats)
            stop_at = time.monotonic() + cfg.duration
            tasks = [asyncio.create_task(client.run(i, stop_at)) for i in range(cfg.clients)]
            await asyncio.sleep(cfg.duration / 10)  # the warm-up: first-use allocations, arenas, caches
            after_warm_up = await sample_metrics(probe, started)
            done, pending = await asyncio.wait(tasks, timeout=cfg.duration * 0.9 + cfg.finish_timeout)
            for task in pending:  # stuck past every timeout: count it, do not wait for ever
                task.cancel()
                stats.problem("a client was still waiting after the finish timeout")
            for task in done:
                if task.exception() is not None:
                    stats.problem(f"a client crashed: {task.exception()!r}")
        traffic_seconds = time.monotonic() - started
        stop_probes.set()
        await asyncio.gather(*probes)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=10) as fresh:  # no pooled sockets
        after = await settle(fresh, started)
    return report(cfg, stats, before, after_warm_up, after, traffic_seconds)


def report(cfg: SoakConfig, stats: SoakStats, before: dict[str, float], after_warm_up: dict[str, float],
           after: dict[str, float], traffic_seconds: float) -> dict[str, Any]:
    mib = 1 / (1 << 20)
    peak_rss = max([s["rss"] for s in stats.samples] + [after["rss"]])
    ram_tier_growth = (after["ram_tier"] - after_warm_up["ram_tier"]) * mib
    rss_growth_after_warm_up = (after["rss"] - after_warm_up["rss"]) * mib - ram_tier_growth
    health_p99 = percentile(stats.health_ms, 99)
    results = {
        "requests": stats.num_requests, "streams_completed": stats.num_streams_completed,
        "disconnects": stats.num_disconnects, "malformed_sent": stats.num_malformed_sent,
        "malformed_refused_4xx": stats.num_malformed_refused, "rejected_429": stats.num_rejected,
        "server_errors_5xx": stats.num_5xx, "error_events": stats.num_error_events,
        "transport_errors": stats.num_transport_errors, "problems": len(stats.problems),
        "completion_tokens_in_usage": stats.num_completion_tokens,
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "server_aborts": after["aborted"] - before["aborted"], "server_failures": after["failed"] - before["failed"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "kv_blocks_total": after["kv_total"], "kv_blocks_used_at_rest": after["kv_used"],
        "running_at_rest": after["running"], "waiting_at_rest": after["waiting"],
        "rss_before_mib": before["rss"] * mib, "rss_after_warm_up_mib": after_warm_up["rss"] * mib,
        "rss_at_rest_mib": after["rss"] * mib, "rss_peak_mib": peak_rss * mib,
        "rss_growth_mib": (after["rss"] - before["rss"]) * mib,
        "rss_growth_after_warm_up_mib": rss_growth_after_warm_up,
        "prefix_cache_ram_tier_growth_after_warm_up_mib": ram_tier_growth,
        "open_fds_before": before["fds"], "open_fds_at_rest": after["fds"],
        "health_probes": len(stats.health_ms), "health_failures": stats.num_health_failures,
        "health_p50_ms": percentile(stats.health_ms, 50), "health_p99_ms": health_p99,
        "ttft_p50_ms": percentile(stats.ttft_ms, 50), "ttft_p99_ms": percentile(stats.ttft_ms, 99),
        "health_max_ms": max(stats.health_ms, default=float("nan")), "traffic_seconds": traffic_seconds,
    }
    checks = [
        ("no 5xx", stats.num_5xx == 0, f"{stats.num_5xx}"),
        ("no error events", stats.num_error_events == 0, f"{stats.num_error_events}"),
        ("no failed connections", stats.num_transport_errors == 0, f"{stats.num_transport_errors}"),
        ("malformed requests answered 4xx", stats.num_malformed_refused == stats.num_malformed_sent,
         f"{stats.num_malformed_refused} of {stats.num_malformed_sent}"),
        ("streams well formed", not stats.problems, f"{len(stats.problems)} problems"),
        ("KV blocks back to 0", after["kv_used"] == 0, f"{after['kv_used']:.0f} used of {after['kv_total']:.0f}"),
        ("no request running or waiting", after["running"] == 0 and after["waiting"] == 0,
         f"{after['running']:.0f} running, {after['waiting']:.0f} waiting"),
        ("open fds back to baseline", after["fds"] <= before["fds"] + FD_SLACK,
         f"{before['fds']:.0f} → {after['fds']:.0f}"),
        ("RSS growth after warm-up", rss_growth_after_warm_up <= cfg.max_rss_growth_mib,
         f"{rss_growth_after_warm_up:+.1f} MiB net of the prefix cache's RAM tier ({ram_tier_growth:+.1f}) "
         f"(limit {cfg.max_rss_growth_mib:g})"),
        ("/health p99", health_p99 <= cfg.max_health_p99_ms and stats.num_health_failures == 0,
         f"{health_p99:.1f} ms (limit {cfg.max_health_p99_ms:g}), {stats.num_health_failures} failed"),
    ]
    return {"config": asdict(cfg) | {"api_key": None}, "results": results,
            "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
            "problems": stats.problems[:50], "metrics_samples": stats.samples, "passed": all(c[1] for c in checks)}


def print_report(out: dict[str, Any]) -> None:
    cfg, r = out["config"], out["results"]
    print(f"treadle bench soak: {cfg['clients']} clients, {cfg['duration']:g} s, disconnect rate "
          f"{cfg['disconnect_rate']:g}, malformed rate {cfg['malformed_rate']:g}, against {cfg['base_url']}")
    rows = [
        ("requests", f"{r['requests']} generation + {r['malformed_sent']} malformed, {r['traffic_seconds']:.0f} s"),
        ("completed", f"{r['streams_completed']} (streams and whole answers, each checked)"),
        ("left mid-request", f"{r['disconnects']} (server counted {r['server_aborts']:.0f} aborts)"),
        ("malformed → 4xx", f"{r['malformed_refused_4xx']} of {r['malformed_sent']}"),
        ("429 (queue full)", f"{r['rejected_429']}"),
        ("5xx / error events", f"{r['server_errors_5xx']} / {r['error_events']}"),
        ("preemptions", f"{r['preemptions']:.0f}"),
        ("KV blocks at rest", (f"{r['kv_blocks_used_at_rest']:.0f} used of {r['kv_blocks_total']:.0f}; "
                               f"{r['running_at_rest']:.0f} running, {r['waiting_at_rest']:.0f} waiting")),
        ("RSS (MiB)", (f"{r['rss_before_mib']:.0f} before, {r['rss_after_warm_up_mib']:.0f} after warm-up, "
                       f"{r['rss_at_rest_mib']:.0f} at rest, {r['rss_peak_mib']:.0f} peak: "
                       f"{r['rss_growth_after_warm_up_mib']:+.1f} after warm-up net of the prefix cache's RAM tier "
                       f"({r['prefix_cache_ram_tier_growth_after_warm_up_mib']:+.1f}), "
                       f"{r['rss_growth_mib']:+.1f} in all")),
        ("open fds", f"{r['open_fds_before']:.0f} before, {r['open_fds_at_rest']:.0f} at rest"),
        ("first token (ms)", f"p50 {r['ttft_p50_ms']:.0f}, p99 {r['ttft_p99_ms']:.0f} (queueing included)"),
        ("/health (ms)", (f"p50 {r['health_p50_ms']:.1f}, p99 {r['health_p99_ms']:.1f}, "
                          f"max {r['health_max_ms']:.1f} over {r['health_probes']} probes, "
                          f"{r['health_failures']} failed")),
    ]
    for name, value in rows:
        print(f"  {name:<20} {value}")
    for check in out["checks"]:
        print(f"  {'PASS' if check['ok'] else 'FAIL'}  {check['name']}: {check['detail']}")
    for problem in out["problems"][:10]:
        print(f"  problem: {problem}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treadle bench soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--base-url", default=d.base_url, help="the running server (default %(default)s)")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of traffic (default %(default)s)")
    p.add_argument("--clients", type=int, default=d.clients, help="concurrent clients (default %(default)s)")
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate,
                   help="fraction of requests whose client leaves before the end (default %(default)s)")
    p.add_argument("--malformed-rate", type=float, default=d.malformed_rate,
                   help="fraction of requests that are malformed (default %(default)s)")
    p.add_argument("--max-prompt-words", type=int, default=d.max_prompt_words, help="(default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="largest max_tokens drawn (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default %(default)s)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--max-rss-growth-mib", type=float, default=d.max_rss_growth_mib,
                   help="allowed growth of the server's RSS after the warm-up (default %(default)s)")
    p.add_argument("--max-health-p99-ms", type=float, default=d.max_health_p99_ms,
                   help="allowed p99 latency of GET /health during the run (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if (args.clients < 1 or args.duration <= 0 or not 0 <= args.disconnect_rate <= 1
            or not 0 <= args.malformed_rate <= 1):
        print("treadle bench soak: --clients ≥ 1, --duration > 0, rates in [0, 1]", file=sys.stderr)
        return 2
    cfg = SoakConfig(base_url=args.base_url.rstrip("/"), duration=args.duration, clients=args.clients,
                     disconnect_rate=args.disconnect_rate, malformed_rate=args.malformed_rate,
                     max_prompt_words=args.max_prompt_words, max_tokens=args.max_tokens, seed=args.seed,
                     api_key=args.api_key, max_rss_growth_mib=args.max_rss_growth_mib,
                     max_health_p99_ms=args.max_health_p99_ms)
    try:
        out = asyncio.run(soak(cfg))
    except httpx.HTTPError as exc:
        print(f"treadle bench soak: cannot reach {cfg.base_url}: {exc}", file=sys.stderr)
        return 2
    print_report(out)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
