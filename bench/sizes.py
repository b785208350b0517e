"""`treadle bench sizes FILE.gguf ...`: treadle beside llama-server on a model file, and both beside the roofs.

    .venv/bin/treadle bench sizes /tmp/qwen2.5-1.5b.gguf /tmp/qwen2.5-7b.gguf [--threads 2]
        [--streams 1,8,32] [--prompt-tokens 512] [--contexts 1024,8192,32768] [--json PATH]

Made for the sizes people serve (files from `treadle bench synth`, or real ones). For each file, one
server at a time on loopback, the file's pages warm in the page cache:

- treadle's first start (an empty weight cache: the repacking is paid and the cache written), its
  second start (the cache mapped), and llama-server's start: seconds from the process's start to
  /health answering 200, and the process's peak resident memory (VmHWM) by then and at the end;
- one stream decoding 128 tokens (time per output token), then `--streams` levels of streams decoding
  together (aggregate tokens/s), then one prompt of --prompt-tokens tokens (its time to first token:
  prompt tokens/s);
- with --contexts, long contexts: a server with one slot that holds the longest (llama-server with
  flash attention on), and for each length one prompt of about that many tokens (prefill tokens/s
  from its time to first token) and 32 tokens decoded after it (time per token at that context);
  treadle and llama-server each with a float16 and an int8 (q8_0) KV cache;
- after the servers, the roofs on the same threads: the read bandwidth of the pool's threads and the
  int8 rate of the fast kernels (bench/engine_rooflines.py). A single stream's share of the memory roof
  is the bytes of weights treadle reads per token (its repacked form) over time per token against the
  bandwidth; a prompt's share of the int8 roof is multiply-accumulates per prompt token (every matrix
  but the LM head, run once per prompt) against the int8 rate. In a mixture of experts a token reads
  and multiplies only its chosen experts (and the router); beside each level of streams, the share
  of expert weights a step of that many tokens reads when routing is uniform (as noise weights route).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve import BenchConfig, machine_description, run_bench
from bench.servers import ServerLog, free_port, stop, wait_until_ready
from bench.side_by_side import PEERS


def _vm_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _warm_page_cache(path: Path) -> None:
    with path.open("rb") as f:
        while f.read(64 << 20):
            pass


# Requests per level: the median of three at one stream (nine 128-token answers took 5 minutes on a 7B
# shape); a level of C streams sends C each, once.
REQUESTS_ALONE = 3


def _run_levels(base_url: str, levels: list[int], max_tokens: int, prompt_tokens: int, ignore_eos: bool,
                extra_body: dict[str, Any], requests: int = REQUESTS_ALONE, warmup: int = 1) -> dict[str, Any]:
    if not levels:
        return {"levels": []}
    config = BenchConfig(base_url=base_url, model=None, chat=False, concurrency=levels, requests=requests,
                         max_tokens=max_tokens, prompt_tokens=prompt_tokens, temperature=0.0, ignore_eos=ignore_eos,
                         warmup=warmup, seed=0, timeout_s=3600, knee_metric="ttft", knee_factor=1.5, progress=False,
                         extra_body=extra_body)  # fmt: skip
    return asyncio.run(run_bench(config))


def measure_server(name: str, gguf: Path, threads: int, streams: list[int], prompt_tokens: int,
                   env: dict[str, str] | None = None, serve: bool = True) -> dict[str, Any]:  # fmt: skip
    """Start one peer on `gguf`; its start time and peak memory, then (with `serve`) its speeds."""
    peer = PEERS[name]
    port = free_port()
    argv = peer.command(port, gguf, threads, max(streams))
    if argv is None:
        return {"skipped": peer.why_missing}
    if "--ctx-size" in argv:  # llama-server splits its context over its slots: room for the long prompt in each
        argv[argv.index("--ctx-size") + 1] = str(max(streams) * (prompt_tokens + 512))
    log = ServerLog(f"sizes-{name}-")
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=log.file, stderr=subprocess.STDOUT,
                               env={**os.environ, **peer.env(threads), **(env or {})})  # fmt: skip
    try:
        why_not = wait_until_ready(process, f"http://127.0.0.1:{port}{peer.ready_path}", 1800, poll_s=0.1)
        if why_not is not None:
            return {"skipped": f"{why_not} (log: {log.keep()})"}
        result: dict[str, Any] = {"command": " ".join(argv), "start_s": time.perf_counter() - started,
                                  "peak_rss_mb_at_ready": (_vm_kib(process.pid, "VmHWM") or 0) / 1024}  # fmt: skip
        if not serve:
            return result
        base_url = f"http://127.0.0.1:{port}"
        extra = peer.extra_body(128)
        try:  # a phase that fails is named in the report; the others are kept
            single = _run_levels(base_url, [1], 128, 32, peer.ignore_eos, extra)["levels"][0]
            result["decode_ms_per_token"] = single["tpot_ms"]["p50"]
            prompt = _run_levels(base_url, [1], 1, prompt_tokens, peer.ignore_eos, peer.extra_body(1))["levels"][0]
            result["prompt_ttft_ms"] = prompt["ttft_ms"]["p50"]
            result["prompt_tokens"] = prompt["mean_prompt_tokens"] or prompt_tokens
            together = _run_levels(base_url, [s for s in streams if s > 1], 64, 32, peer.ignore_eos, extra)["levels"]
            result["aggregate_tokens_per_s"] = {lv["concurrency"]: lv["output_throughput"] for lv in together}
        except RuntimeError as exc:
            result["error"] = str(exc)
            print(f"{gguf.name}: {name}: {exc} (log: {log.keep()})", file=sys.stderr)
        result["peak_rss_mb"] = (_vm_kib(process.pid, "VmHWM") or 0) / 1024
        if name == "treadle":
            result["prefix_ram_mb"] = _prefix_ram_mib(base_url)
        return result
    finally:
        stop(process, timeout_s=30)
        log.close()


def _prefix_ram_mib(base_url: str) -> float | None:
    """What treadle's host-memory prefix tier holds (its /metrics): KV blocks the KV pool evicted, kept
    under their own budget (--prefix-cache-ram-mb) beside the pool's."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith('treadle_prefix_cache_tier_bytes{tier="ram"}'):
            return float(line.split()[-1]) / 2**20
    return 0.0


# llama-server's and treadle's options for the long-context servers: one slot holding the longest
# context, flash attention on (llama.cpp's long-context path; its q8_0 V cache needs it)
KV_OPTIONS = {"llama-server": {"float16": ["-fa", "on"], "int8": ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]},
              "treadle": {"float16": ["--kv-cache-dtype", "float16"], "int8": ["--kv-cache-dtype", "int8"]}}
CONTEXT_DECODE_TOKENS = 32


def measure_contexts(name: str, gguf: Path, threads: int, contexts: list[int], kv_dtype: str) -> dict[str, Any]:
    """Prefill speed and time per decoded token with `contexts` tokens already in the KV cache."""
    peer = PEERS[name]
    port = free_port()
    argv = peer.command(port, gguf, threads, 1)
    if argv is None:
        return {"skipped": peer.why_missing}
    room = max(contexts) + CONTEXT_DECODE_TOKENS + 64
    if "--ctx-size" in argv:
        argv[argv.index("--ctx-size") + 1] = str(room)
    else:
        argv += ["--max-model-len", str(room), "--max-num-seqs", "1", "--no-enable-prefix-caching",
                 "--kv-cache-mb", "auto"]
    argv += KV_OPTIONS[name][kv_dtype]
    log = ServerLog(f"sizes-{name}-ctx-")
    process = subprocess.Popen(argv, stdout=log.file, stderr=subprocess.STDOUT, env={**os.environ, **peer.env(threads)})
    try:
        why_not = wait_until_ready(process, f"http://127.0.0.1:{port}{peer.ready_path}", 1800, poll_s=0.1)
        if why_not is not None:
            return {"skipped": f"{why_not} (log: {log.keep()})"}
        result: dict[str, Any] = {"command": " ".join(argv), "contexts": {}}
        for context in contexts:
            # word salad is about a token a word: 2% fewer words keeps the prompt inside the context
            words = int(context * 0.98)
            try:
                level = _run_levels(f"http://127.0.0.1:{port}", [1], CONTEXT_DECODE_TOKENS, words, peer.ignore_eos,
                                    peer.extra_body(CONTEXT_DECODE_TOKENS), requests=1, warmup=0)["levels"][0]
            except RuntimeError as exc:
                result["contexts"][context] = {"error": str(exc)}
                print(f"{gguf.name}: {name} {kv_dtype} at {context}: {exc} (log: {log.keep()})", file=sys.stderr)
                continue
            if level["ttft_ms"]["p50"] is None:
                result["contexts"][context] = {"error": level.get("errors")}
                print(f"{gguf.name}: {name} {kv_dtype} at {context}: {level.get('errors')} (log: {log.keep()})",
                      file=sys.stderr)
                continue
            tokens = level["mean_prompt_tokens"] or words
            result["contexts"][context] = {"prompt_tokens": tokens, "ttft_ms": level["ttft_ms"]["p50"],
                                           "prefill_tokens_per_s": tokens * 1000 / level["ttft_ms"]["p50"],
                                           "decode_ms_per_token": level["tpot_ms"]["p50"]}  # fmt: skip
            print(f"{gguf.name}: {name} {kv_dtype} KV at {tokens} tokens: prefill "
                  f"{result['contexts'][context]['prefill_tokens_per_s']:.1f} tokens/s, decode "
                  f"{level['tpot_ms']['p50']:.1f} ms/token", flush=True)
        result["peak_rss_mb"] = (_vm_kib(process.pid, "VmHWM") or 0) / 1024
        return result
    finally:
        stop(process, timeout_s=30)
        log.close()


def context_table(path: Path, runs: dict[str, dict[str, Any]], contexts: list[int]) -> str:
    names = [n for n in runs if "skipped" not in runs[n]]
    header = _row("", [f"{c} tokens: prefill tok/s, decode ms/token" for c in contexts])
    lines = [f"**{path.name}** at long contexts (one slot; llama-server with flash attention)", "", header,
             "|" + " --- |" * len(contexts) + " --- |"]
    for name in names:
        cells = []
        for c in contexts:
            r = runs[name]["contexts"].get(c, {})
            cells.append(f"{r['prefill_tokens_per_s']:.1f}, {r['decode_ms_per_token']:.1f}" if "ttft_ms" in r
                         else "—")
        lines.append(_row(name, cells))
    return "\n".join(lines)


def model_costs(gguf: Path, threads: int) -> dict[str, Any]:
    """Bytes of weights treadle reads per decode token, multiply-accumulates per prompt token, and the roofs."""
    from bench.batch_decode import decode_macs_per_token, prompt_macs_per_token
    from bench.engine_rooflines import measure_int8_gmacs, measure_read_bandwidth
    from decoding import load_model
    from decoding.kernels.amx import HARDWARE
    from decoding.kernels.amx_probe import tile_support
    from decoding.kernels.forward import bytes_read_per_token

    model = load_model(gguf)
    cfg = model.config
    attention = (cfg.q_dim + 2 * cfg.kv_dim) * cfg.dim + cfg.dim * cfg.q_dim
    feed_forward = 3 * cfg.dim * cfg.hidden_dim  # one expert's, in a mixture
    experts, used = max(cfg.n_experts, 1), max(cfg.n_experts_used, 1)
    return {
        "parameters_b": (cfg.n_layers * (attention + experts * feed_forward) + 2 * cfg.vocab_size * cfg.dim) / 1e9,
        "active_parameters_b": (cfg.n_layers * (attention + used * feed_forward) + 2 * cfg.vocab_size * cfg.dim) / 1e9,
        "file_gb": gguf.stat().st_size / 1e9,
        "decode_bytes_per_token": bytes_read_per_token(cfg, model.weights, fast=True),
        "prompt_macs_per_token": prompt_macs_per_token(cfg),
        "decode_macs_per_token": decode_macs_per_token(cfg),  # the prompt's and the LM head's
        "n_experts": cfg.n_experts,
        "n_experts_used": cfg.n_experts_used,
        "read_gb_per_s": measure_read_bandwidth(threads),
        "int8_gmacs": measure_int8_gmacs(model, threads),
        # what `--kernels fast` runs prompts on where AMX is granted: then the prompts' roof
        "amx_int8_gmacs": measure_int8_gmacs(model, threads, tile_mode=HARDWARE) if tile_support().granted else None,
    }


def expert_share(n_experts: int, n_used: int, n_tokens: int) -> float:
    """The expected share of experts a step of `n_tokens` tokens reads, each choosing `n_used` of
    `n_experts` uniformly: 1 − (1 − n_used / n_experts)^n_tokens."""
    return 1.0 - (1.0 - n_used / n_experts) ** n_tokens


def _row(label: str, values: list[str]) -> str:
    return "| " + " | ".join([label, *values]) + " |"


def report_table(path: Path, costs: dict[str, Any], runs: dict[str, dict[str, Any]], streams: list[int]) -> str:
    from decoding.kernels.amx import FEWEST_TILED_TOKENS

    names = [n for n in runs if "skipped" not in runs[n]]
    header = _row("", names + (["treadle / llama-server"] if {"treadle", "llama-server"} <= set(names) else []))
    active = (f" ({costs['active_parameters_b']:.2f}B active: {costs['n_experts_used']} of {costs['n_experts']} "
              "experts)" if costs.get("n_experts") else "")
    lines = [f"**{path.name}** — {costs['parameters_b']:.2f}B parameters{active}, {costs['file_gb']:.2f} GB; "
             f"{costs['decode_bytes_per_token'] / 1e9:.2f} GB read per decoded token; roofs: read "
             f"{costs['read_gb_per_s']:.1f} GB/s, int8 {costs['int8_gmacs'] or 0:.0f} GMAC/s"
             + (f", AMX tiles {costs['amx_int8_gmacs']:.0f} GMAC/s" if costs.get("amx_int8_gmacs") else ""), "",
             header, "|" + " --- |" * (header.count("|") - 1)]  # fmt: skip

    def add(label: str, value_of, fmt: str, higher_is_better: bool = True) -> None:  # type: ignore[no-untyped-def]
        values = [value_of(runs[n]) for n in names]
        cells = [fmt.format(v) if v is not None else "—" for v in values]
        if {"treadle", "llama-server"} <= set(names):
            t, p = value_of(runs["treadle"]), value_of(runs["llama-server"])
            cells.append(f"{t / p:.2f}x" if t and p else "—")
        lines.append(_row(label, cells))

    decode = costs["decode_bytes_per_token"]
    add("start to healthy, s", lambda r: r.get("start_s"), "{:.1f}")
    def peak(r: dict[str, Any]) -> float | None:
        return r.get("peak_rss_mb") or r.get("peak_rss_mb_at_ready")

    add("peak RSS, MiB", peak, "{:.0f}")
    # what the process holds beyond its model: treadle's KV cache (512 MiB unless told) and the rest of the
    # process, against the bound of KV + 300 MiB; llama-server's KV and compute buffers
    file_mib = costs["file_gb"] * 1e9 / 2**20
    add("peak RSS beyond the file, MiB", lambda r: peak(r) - file_mib if peak(r) else None, "{:.0f}")
    if any(r.get("prefix_ram_mb") is not None for r in runs.values()):
        add("of which prefix cache in host memory at the end, MiB", lambda r: r.get("prefix_ram_mb"), "{:.0f}")
    add("1 stream, tokens/s", lambda r: 1000 / r["decode_ms_per_token"] if r.get("decode_ms_per_token") else None,
        "{:.2f}")
    add("1 stream, share of read roof", lambda r: decode * 1000 / r["decode_ms_per_token"] / 1e9
        / costs["read_gb_per_s"] if r.get("decode_ms_per_token") else None, "{:.0%}")
    for s in streams:
        if s > 1:
            label = f"{s} streams, tokens/s"
            if costs.get("n_experts"):
                share = expert_share(costs["n_experts"], costs["n_experts_used"], s)
                label += f" (a step reads {share:.0%} of experts)"
            add(label, lambda r, s=s: (r.get("aggregate_tokens_per_s") or {}).get(s), "{:.1f}")
            if costs["int8_gmacs"]:  # a batch's step is int8 dot products (through HTTP: with its prompts too)
                roof = costs.get("amx_int8_gmacs") if s >= FEWEST_TILED_TOKENS else None  # the tiles from there
                macs = costs.get("decode_macs_per_token") or costs["prompt_macs_per_token"]
                add(f"{s} streams, share of {'the AMX tiles' if roof else 'int8'} roof",
                    lambda r, s=s, roof=roof or costs["int8_gmacs"], macs=macs:
                    (r.get("aggregate_tokens_per_s") or {}).get(s) * macs / 1e9 / roof
                    if (r.get("aggregate_tokens_per_s") or {}).get(s) else None, "{:.0%}")
    add("prompt, tokens/s", lambda r: r["prompt_tokens"] * 1000 / r["prompt_ttft_ms"] if r.get("prompt_ttft_ms")
        else None, "{:.1f}")
    prompt_roof = costs.get("amx_int8_gmacs") or costs["int8_gmacs"]
    if prompt_roof:
        add(f"prompt, share of {'the AMX tiles' if costs.get('amx_int8_gmacs') else 'int8'} roof",
            lambda r: r["prompt_tokens"] * 1000 / r["prompt_ttft_ms"] * costs["prompt_macs_per_token"] / 1e9
            / prompt_roof if r.get("prompt_ttft_ms") else None, "{:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench sizes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", default="1,8,32", help="levels of concurrent streams (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--peers", default="treadle,llama-server")
    parser.add_argument("--contexts", default="", help="long contexts to measure, e.g. 1024,8192,32768 (default none)")
    parser.add_argument("--contexts-only", action="store_true", help="only the long contexts: no start, streams "
                                                                     "or prompt figures")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    streams = sorted({int(s) for s in args.streams.split(",")})
    peers = [p.strip() for p in args.peers.split(",")]
    results: dict[str, Any] = {"machine": machine_description(), "date": time.strftime("%Y-%m-%d %H:%M"),
                               "command": " ".join(["treadle bench sizes", *(argv or sys.argv[1:])]), "files": {}}
    tables = []
    contexts = sorted({int(c) for c in args.contexts.split(",") if c})
    for path in args.files:
        _warm_page_cache(path)
        runs: dict[str, dict[str, Any]] = {}
        for peer in [] if args.contexts_only else peers:
            if peer == "treadle":  # the first start repacks into an empty weight cache, the second maps it
                cache = Path(tempfile.mkdtemp(prefix="sizes-weights-"))
                env = {"TREADLE_WEIGHT_CACHE_DIR": str(cache)}
                runs["treadle (first start)"] = measure_server("treadle", path, args.threads, streams,
                                                               args.prompt_tokens, env, serve=False)  # fmt: skip
                runs["treadle"] = measure_server("treadle", path, args.threads, streams, args.prompt_tokens, env)
                shutil.rmtree(cache, ignore_errors=True)
            else:
                runs[peer] = measure_server(peer, path, args.threads, streams, args.prompt_tokens)
            for name, run in runs.items():
                if "skipped" in run:
                    print(f"{path.name}: {name} skipped ({run['skipped']})", file=sys.stderr)
        context_runs = {f"{peer} {kv}": measure_contexts(peer, path, args.threads, contexts, kv)
                        for peer in peers if contexts for kv in ("float16", "int8")}  # fmt: skip
        costs = model_costs(path, args.threads)
        results["files"][str(path)] = {"costs": costs, "runs": runs, "contexts": context_runs}
        if runs:
            tables.append(report_table(path, costs, runs, streams))
            print(tables[-1] + "\n", flush=True)
        if context_runs:
            tables.append(context_table(path, context_runs, contexts))
            print(tables[-1] + "\n", flush=True)
        if args.json:  # after each file: a 7B file's run is long, and what was measured is kept if it is cut
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    machine = results["machine"]
    print(f"{results['date']}, {machine['cpu']} ({platform.machine()}), {args.threads} threads; `{results['command']}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
