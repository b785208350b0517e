"""`treadle bench prefix-tiers MODEL`: what the prefix cache's tiers bring to a long system prompt.

    .venv/bin/treadle bench prefix-tiers /tmp/shapes/qwen2.5-1.5b-q4_k_m.gguf [--system-tokens 4000]
        [--threads 2] [--agents 3] [--agent-tokens 1000] [--json PATH]

One `treadle serve` at a time on loopback, a KV pool just larger than the system prompt, prompts sent
as token ids (a system prompt of --system-tokens ids, then a short user turn of fresh ids each time),
time to first token measured by a streaming client:

- cold: the system prompt is computed (with the tiers on, so their write-through is paid here);
- pool: the same system prompt with another user turn (found in the KV pool);
- ram: after another prompt as long as the pool evicted it (copied back from host memory);
- disk: after a graceful restart, the block files dropped from the page cache (posix_fadvise), so
  they are read from the device (copied back from disk).

Then a mixed workload where the pool alone cannot keep up: --agents agents, each with its own system
prompt of --agent-tokens ids, take turns for --rounds rounds, on a pool holding about one and a half
of them; the median time to first token of the turns after each agent's first, with the tiers off
(every turn recomputes) and on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.serve import machine_description
from bench.servers import ServerLog, free_port, stop, wait_until_ready

BLOCK_SIZE = 16
USER_TOKENS = 24


class Server:
    def __init__(self, model: Path, threads: int, num_blocks: int, tier_args: list[str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = ServerLog("prefix-tiers-")
        argv = [sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--port", str(self.port),
                "--threads", str(threads), "--num-kv-blocks", str(num_blocks), "--max-num-seqs", "4", *tier_args]
        self.command = " ".join(["treadle", *argv[3:]])
        self.process = subprocess.Popen(argv, stdout=self.log.file, stderr=subprocess.STDOUT)
        why_not = wait_until_ready(self.process, f"{self.base_url}/health", 1800)
        if why_not is not None:
            stop(self.process)
            self.log.close()
            raise RuntimeError(f"treadle serve {why_not}:\n{self.log.text()[-3000:]}")

    def ttft_ms(self, prompt: list[int]) -> float:
        """Milliseconds from sending the prompt to its first streamed token."""
        body = {"prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
        started = time.perf_counter()
        with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=3600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    return (time.perf_counter() - started) * 1000
        raise RuntimeError("the stream ended without a token")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.base_url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        stop(self.process, timeout_s=60)
        self.log.close()


def token_id_bound(model: Path) -> int:
    """Prompt ids are drawn below this: the vocabulary's ordinary tokens (special ones sit at its end)."""
    if model.is_dir():
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    else:
        from gguf import GGUFReader

        vocab = len(GGUFReader(model).fields["tokenizer.ggml.tokens"].data)
    return int(vocab * 0.95)


def drop_page_cache(directory: Path) -> int:
    """Ask the kernel to drop the block files' pages (POSIX_FADV_DONTNEED needs no privilege);
    returns the bytes it was asked to drop."""
    total = 0
    for path in directory.glob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def single_prompt(model: Path, threads: int, system_tokens: int, vocab: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab, size=n).tolist()

    system = ids(system_tokens)
    num_blocks = -(-(system_tokens + 2 * USER_TOKENS) // BLOCK_SIZE) + 8
    directory = Path(tempfile.mkdtemp(prefix="prefix-tiers-disk-"))
    tiers = ["--prefix-cache-ram-mb", "8192", "--prefix-cache-dir", str(directory)]
    result: dict[str, Any] = {"system_tokens": system_tokens, "kv_blocks": num_blocks}
    server = Server(model, threads, num_blocks, tiers)
    try:
        result["command"] = server.command
        result["cold_ms"] = server.ttft_ms(system + ids(USER_TOKENS))
        result["cold_copy_seconds"] = sum(server.metric(f'treadle_prefix_cache_tier_copy_seconds_total{{tier="{t}"}}')
                                          for t in ("ram", "disk"))  # the write-through, on both threads
        result["pool_ms"] = server.ttft_ms(system + ids(USER_TOKENS))
        server.ttft_ms(ids(num_blocks * BLOCK_SIZE - 8))  # another agent's prompt: the pool evicts ours
        hits_before = server.metric('treadle_prefix_cache_tier_hits_total{tier="ram"}')
        result["ram_ms"] = server.ttft_ms(system + ids(USER_TOKENS))
        result["ram_hit_blocks"] = server.metric('treadle_prefix_cache_tier_hits_total{tier="ram"}') - hits_before
    finally:
        server.stop()
    result["disk_bytes"] = sum(p.stat().st_size for p in directory.glob("*.kvb"))
    result["page_cache_dropped_bytes"] = drop_page_cache(directory)
    server = Server(model, threads, num_blocks, tiers)
    try:
        result["disk_ms"] = server.ttft_ms(system + ids(USER_TOKENS))
        result["disk_hit_blocks"] = server.metric('treadle_prefix_cache_tier_hits_total{tier="disk"}')
    finally:
        server.stop()
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    return result


def mixed(model: Path, threads: int, agents: int, agent_tokens: int, rounds: int, vocab: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    systems = [rng.integers(100, vocab, size=agent_tokens).tolist() for _ in range(agents)]
    num_blocks = int(1.5 * agent_tokens / BLOCK_SIZE) + 8
    result: dict[str, Any] = {"agents": agents, "agent_tokens": agent_tokens, "rounds": rounds,
                              "kv_blocks": num_blocks}
    for name, tier_args in (("tiers off", ["--prefix-cache-ram-mb", "0"]), ("tiers on", ["--prefix-cache-ram-mb",
                                                                                         "8192"])):
        server = Server(model, threads, num_blocks, tier_args)
        try:
            turns: list[float] = []
            for round_index in range(rounds):
                for system in systems:
                    ms = server.ttft_ms(system + rng.integers(100, vocab, size=USER_TOKENS).tolist())
                    if round_index > 0:
                        turns.append(ms)
            result[name] = {"median_ttft_ms": statistics.median(turns), "turns_ms": turns}
        finally:
            server.stop()
    return result


def report(result: dict[str, Any]) -> str:
    single = result["single"]
    cold = single["cold_ms"]
    lines = [f"{result['model']} ({result['model_mb']:.0f} MB), {result['machine']['cpu']}, {result['threads']} "
             f"threads, {result['date']}",
             f"a {single['system_tokens']}-token system prompt, time to first token:",
             "| from | TTFT ms | cold / this |", "| --- | ---: | ---: |"]
    for label, key in (("cold (computed)", "cold_ms"), ("KV pool", "pool_ms"), ("host memory", "ram_ms"),
                       ("disk, after a restart, page cache dropped", "disk_ms")):
        lines.append(f"| {label} | {single[key]:,.0f} | {cold / single[key]:.1f}x |")
    mix = result.get("mixed")
    if mix:
        off, on = mix["tiers off"]["median_ttft_ms"], mix["tiers on"]["median_ttft_ms"]
        lines += ["", f"{mix['agents']} agents with {mix['agent_tokens']}-token system prompts taking turns on a pool "
                      f"of {mix['kv_blocks']} blocks: median TTFT of their later turns",
                  "| tiers | TTFT ms |", "| --- | ---: |", f"| off | {off:,.0f} |", f"| on | {on:,.0f} |",
                  f"on is {off / on:.1f}x faster"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench prefix-tiers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--agent-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-mixed", action="store_true", help="only the single system prompt")
    parser.add_argument("--json", type=Path, default=Path("bench-results/prefix_tiers.json"))
    args = parser.parse_args(argv)
    vocab = token_id_bound(args.model)
    result: dict[str, Any] = {
        "command": " ".join(["treadle bench prefix-tiers", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "machine": machine_description(), "threads": args.threads,
        "model": args.model.name, "model_mb": args.model.stat().st_size / 1e6 if args.model.is_file() else 0,
    }
    result["single"] = single_prompt(args.model, args.threads, args.system_tokens, vocab)
    if not args.no_mixed:
        result["mixed"] = mixed(args.model, args.threads, args.agents, args.agent_tokens, args.rounds, vocab)
    print(report(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
