#!/usr/bin/env python3
"""The same streaming load against treadle and its peers, on the same GGUF file, one server at a time.

    make bench                                   # installs what it needs, then runs this
    .venv/bin/python bench/side_by_side.py --concurrency 1,4,16,32 --max-tokens 64 \\
        --plot docs/bench-serve.png --update-readme bench/README.md

Peers, each started here on a free loopback port with the same number of threads and stopped before
the next one starts (so no two compete for the cores):
  * treadle          — `treadle serve --threads N` (fast kernels, continuous batching);
  * llama-server     — llama.cpp's own server, the serving peer: `llama-server --model GGUF --threads N
                       --threads-batch N --parallel P --ctx-size P×512` (continuous batching over P slots,
                       P the highest concurrency), built once by scripts/build_llama_server.sh from the
                       llama.cpp that the pinned llama-cpp-python vendors;
  * llama-cpp-python — `python -m llama_cpp.server --model GGUF --n_threads N --n_threads_batch N
                       --interrupt_requests False` (its default, True, ends a running stream as soon as
                       another request arrives): it serves one request at a time, so it runs only the
                       single-stream level, as a reference;
  * transformers     — `transformers serve DIR --continuous-batching` from .venv-bench (torch on the CPU;
                       DIR holds the GGUF dequantized to float32 by transformers' loader; OMP_NUM_THREADS=N).
A peer that is not installed is skipped with the reason printed.

Load: `treadle bench serve` (bench/serve.py) over /v1/completions with stream: true, ~L-token
synthetic prompts, every request generating --max-tokens (ignore_eos / min_tokens), 2 × C requests
per concurrency level C (at least 8) after warm-up. The table gives each peer's figures and the ratio
treadle / peer: above 1 is better for treadle for tokens/s, below 1 for TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serve import BenchConfig, machine_description, run_bench
from bench.serve_report import format_table, write_plot
from bench.servers import ServerLog, free_port, stop, wait_until_ready
from decoding.model.registry import resolve_model_path

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
README_BEGIN, README_END = "<!-- side-by-side:begin -->", "<!-- side-by-side:end -->"


@dataclass(frozen=True)
class Peer:
    name: str
    command: Callable[[int, Path, int, int], list[str] | None]  # (port, gguf, threads, slots) -> argv, or None
    ready_path: str  # GET this until 200
    why_missing: str
    env: Callable[[int], dict[str, str]] = lambda threads: {}
    # How the peer is told to generate exactly max_tokens: ignore_eos + min_tokens, or its own field.
    ignore_eos: bool = True
    extra_body: Callable[[int], dict[str, Any]] = lambda max_tokens: {}
    max_concurrency: int | None = None  # a server that serves one request at a time runs only the levels up to it


def _treadle(port: int, gguf: Path, threads: int, slots: int = 1) -> list[str]:
    # Speculation off: greedy continuations of synthetic prompts loop, and n-gram drafts of a loop are
    # nearly all accepted -- a gain real chat does not see, and none of the peers speculate.
    return [str(REPO / ".venv/bin/treadle"), "serve", "--port", str(port), "--threads", str(threads),
            "--model", str(gguf), "--log-level", "warning", "--speculative", "off"]


def _has_module(python: Path, module: str) -> bool:
    return python.exists() and subprocess.run([str(python), "-c", f"import {module}"], capture_output=True,
                                              check=False).returncode == 0


def _llama_cpp(port: int, gguf: Path, threads: int, slots: int = 1) -> list[str] | None:
    python = REPO / ".venv/bin/python"
    if not _has_module(python, "llama_cpp.server"):
        return None
    return [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", "2048", "--port", str(port), "--host", "127.0.0.1",
            "--interrupt_requests", "False"]


LLAMA_SERVER_VERSION = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built (the Makefile pins it)


def llama_server_binary() -> Path | None:
    """$LLAMA_SERVER, or what scripts/build_llama_server.sh built into the cache; None if neither exists."""
    if os.environ.get("LLAMA_SERVER"):
        return Path(os.environ["LLAMA_SERVER"])
    script = Path(__file__).resolve().parent.parent / "scripts" / "build_llama_server.sh"
    where = subprocess.run([str(script), "--where"], capture_output=True, text=True, check=True,
                           env={**os.environ, "LLAMA_CPP_PYTHON_VERSION": LLAMA_SERVER_VERSION})  # fmt: skip
    binary = Path(where.stdout.strip())
    return binary if os.access(binary, os.X_OK) else None


def _llama_server(port: int, gguf: Path, threads: int, slots: int = 32) -> list[str] | None:
    binary = llama_server_binary()
    if binary is None:
        return None
    return [str(binary), "--model", str(gguf), "--threads", str(threads), "--threads-batch", str(threads),
            "--parallel", str(slots), "--ctx-size", str(512 * slots), "--port", str(port), "--host", "127.0.0.1",
            "--no-webui"]


def _transformers(port: int, gguf: Path, threads: int, slots: int = 1) -> list[str] | None:
    python = REPO / ".venv-bench/bin/python"
    if not _has_module(python, "transformers.cli.serve") or not _has_module(python, "fastapi"):
        return None
    # `transformers serve DIR:FILE.gguf` fails on this GGUF (no `architectures` in the config it
    # builds), so it serves the same weights written out once by its own GGUF loader.
    hf_dir = REPO / "bench-results" / f"hf-{MODEL}"
    if not (hf_dir / "config.json").exists():
        subprocess.run([str(python), str(REPO / "bench/gguf_to_hf.py"), str(gguf), str(hf_dir)], check=True)
    return [str(REPO / ".venv-bench/bin/transformers"), "serve", str(hf_dir), "--port", str(port),
            "--host", "127.0.0.1", "--continuous-batching",
            # Its KV cache defaults to most of memory (12 GiB here): 16 Ki tokens hold 32 streams of 192 easily.
            "--cb-block-size", "32", "--cb-num-blocks", "512"]


def _min_new_tokens(max_tokens: int) -> dict[str, Any]:
    # transformers serve answers 422 to unknown fields such as ignore_eos; its own knob is a
    # generation_config JSON string (which replaces the model's, EOS included).
    return {"generation_config": json.dumps({"max_new_tokens": max_tokens, "min_new_tokens": max_tokens})}


def _torch_threads(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


PEERS = {
    "treadle": Peer("treadle", _treadle, "/health", "treadle is not installed in .venv (make install)"),
    "llama-server": Peer("llama-server", _llama_server, "/health",
                         "llama-server is not built (scripts/build_llama_server.sh; make bench runs it)"),
    "llama-cpp-python": Peer("llama-cpp-python", _llama_cpp, "/v1/models",
                             "llama-cpp-python is not installed in .venv (make bench installs it)",
                             max_concurrency=1),
    "transformers": Peer("transformers", _transformers, "/v1/models",
                         "transformers serve is not installed in .venv-bench (make bench installs it)",
                         _torch_threads, ignore_eos=False, extra_body=_min_new_tokens),
}


def start(peer: Peer, argv: list[str], threads: int,
          timeout_s: float) -> tuple[subprocess.Popen[bytes], str, ServerLog]:
    port = int(argv[argv.index("--port") + 1])
    log = ServerLog(f"bench-{peer.name}-")
    env = {**os.environ, **peer.env(threads), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(argv, stdout=log.file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base_url = f"http://127.0.0.1:{port}"
    why_not = wait_until_ready(process, base_url + peer.ready_path, timeout_s, poll_s=0.5)
    if why_not is None:
        return process, base_url, log
    process.kill()
    process.wait()
    path = log.keep()
    log.close()
    raise RuntimeError(f"{peer.name} {why_not}; log: {path}")


def settle(max_load: float, timeout_s: float) -> float:
    """Wait until the 1-minute load average is below `max_load` (or `timeout_s` passed); return it."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def _memory_gib() -> float:
    try:
        return int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def level(report: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    return next((lv for lv in report["levels"] if lv["concurrency"] == concurrency and lv["num_completed"]), None)


def metric_rows(concurrency: list[int]) -> list[tuple[str, Callable[[dict[str, Any]], float | None], bool]]:
    """(label, value of a report, higher is better) for each row of the table."""

    def decode_tps(report: dict[str, Any]) -> float | None:
        lv = level(report, 1)
        return 1000.0 / lv["tpot_ms"]["p50"] if lv and lv["tpot_ms"]["p50"] else None

    def aggregate(c: int) -> Callable[[dict[str, Any]], float | None]:
        return lambda report: (lv := level(report, c)) and lv["output_throughput"]

    def percentile(c: int, metric: str, p: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda report: (lv := level(report, c)) and lv[metric][p]

    rows = [("1 stream: decode tokens/s (1 / TPOT p50)", decode_tps, True),
            ("1 stream: TTFT p50 ms", percentile(1, "ttft_ms", "p50"), False)]
    for c in (c for c in concurrency if c >= 16):
        rows += [(f"{c} streams: aggregate output tokens/s", aggregate(c), True),
                 (f"{c} streams: TTFT p50 ms", percentile(c, "ttft_ms", "p50"), False),
                 (f"{c} streams: TTFT p99 ms", percentile(c, "ttft_ms", "p99"), False),
                 (f"{c} streams: inter-token p50 ms", percentile(c, "itl_ms", "p50"), False),
                 (f"{c} streams: inter-token p99 ms", percentile(c, "itl_ms", "p99"), False)]
    return rows


def ratio_table(reports: dict[str, dict[str, Any]], concurrency: list[int]) -> str:
    """Each metric for every server, and treadle / peer: above 1 is better for treadle where higher is
    better (throughput), below 1 where lower is (latencies)."""
    peers = [name for name in reports if name != "treadle"]
    header = ["metric", "treadle"] + [f"{p} | treadle / {p}" for p in peers]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * (1 + 1 + 2 * len(peers))]
    for label, value, _higher_is_better in metric_rows(concurrency):
        mine = value(reports["treadle"]) if "treadle" in reports else None
        cells = [label, f"{mine:.1f}" if mine else "-"]
        for peer in peers:
            theirs = value(reports[peer])
            cells.append(f"{theirs:.1f}" if theirs else "-")
            cells.append(f"**{mine / theirs:.2f}**" if mine and theirs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def int8_roof(threads: int) -> dict[str, float] | None:
    """The int8 kernels' multiply-accumulate rate on this machine now (treadle bench engine's probe), as
    the output tokens/s a batched decode step could at most reach; None where the model has no packable
    matrix."""
    from bench.engine_rooflines import flops_per_token, measure_int8_gmacs
    from decoding.model.registry import load_model

    model = load_model(MODEL)
    gmacs = measure_int8_gmacs(model, threads)
    if gmacs is None:
        return None
    return {"int8_gmacs": gmacs, "tokens_per_second": gmacs * 2e9 / flops_per_token(model)}


def update_readme(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else f"{README_BEGIN}\n{README_END}\n"
    if README_BEGIN not in text or README_END not in text:
        text += f"\n{README_BEGIN}\n{README_END}\n"
    before, rest = text.split(README_BEGIN, 1)
    after = rest.split(README_END, 1)[1]
    path.write_text(f"{before}{README_BEGIN}\n{section}\n{README_END}{after}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="treadle,llama-server,llama-cpp-python,transformers",
                        help="comma-separated, from: " + ", ".join(PEERS))
    parser.add_argument("--threads", type=int, default=2, help="threads of every server (default %(default)s)")
    parser.add_argument("--concurrency", default="1,4,16,32", help="levels (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--start-timeout", type=float, default=600, help="s for a server to become ready")
    parser.add_argument("--settle-load", type=float, default=1.0,
                        help="before each server, wait until the 1-minute load average is below this "
                             "(the previous server's load decays over a minute; default %(default)s)")
    parser.add_argument("--settle-timeout", type=float, default=240, help="s to wait for --settle-load, then go on")
    parser.add_argument("--out", default="bench-results/side_by_side", help="JSON reports go here")
    parser.add_argument("--reuse", default="", help="comma-separated peers whose report is read from --out "
                                                    "(an earlier run) instead of measured again")
    parser.add_argument("--plot", help="PNG of all servers' latency and throughput against concurrency")
    parser.add_argument("--update-readme", help="rewrite the side-by-side section of this markdown file")
    args = parser.parse_args()

    concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    gguf, _ = resolve_model_path(MODEL)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    commands: dict[str, str] = {}
    reuse = {name.strip() for name in args.reuse.split(",") if name.strip()}
    for name in args.peers.split(","):
        peer = PEERS[name.strip()]
        if peer.name in reuse:
            reports[peer.name] = json.loads((out / f"{peer.name}.json").read_text())
            commands[peer.name] = reports[peer.name]["command"]
            continue
        argv = peer.command(free_port(), gguf, args.threads, max(concurrency))
        if argv is None:
            skipped[peer.name] = peer.why_missing
            print(f"== {peer.name}: skipped ({peer.why_missing})", file=sys.stderr)
            continue
        env_words = [f"{k}={v}" for k, v in peer.env(args.threads).items()]
        commands[peer.name] = " ".join([*env_words, shlex.join(argv)]).replace(str(REPO) + "/", "")
        print(f"== {peer.name}: {commands[peer.name].strip()}", file=sys.stderr)
        load_before = settle(args.settle_load, args.settle_timeout)
        try:
            process, base_url, log = start(peer, argv, args.threads, args.start_timeout)
        except RuntimeError as exc:
            skipped[peer.name] = str(exc)
            print(f"== {peer.name}: skipped ({exc})", file=sys.stderr)
            continue
        try:
            levels = [c for c in concurrency if peer.max_concurrency is None or c <= peer.max_concurrency]
            config = BenchConfig(base_url=base_url, model=None, chat=False, concurrency=levels,
                                 requests=None, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                                 temperature=0.0, ignore_eos=peer.ignore_eos, warmup=args.warmup, seed=0,
                                 timeout_s=1800, knee_metric="ttft", knee_factor=1.5,
                                 extra_body=peer.extra_body(args.max_tokens))
            report = asyncio.run(run_bench(config))
        except BaseException:
            print(f"== {peer.name}: its log: {log.keep()}", file=sys.stderr)
            raise
        finally:
            stop(process, timeout_s=30)
            log.close()
        report["label"] = peer.name
        report["command"] = commands[peer.name].strip()
        report["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
        reports[peer.name] = report
        (out / f"{peer.name}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"\n{peer.name}\n{format_table(report)}\n", file=sys.stderr)

    if "treadle" not in reports:
        print("treadle did not run: no ratios", file=sys.stderr)
        return 1
    table = ratio_table(reports, concurrency)
    roof = int8_roof(args.threads)
    if roof is not None:
        top = max(concurrency)
        reached = (lv := level(reports["treadle"], top)) and lv["output_throughput"]
        table += (f"\n\nint8 compute roof, measured after the servers in the same run: "
                  f"{roof['int8_gmacs']:.0f} GMAC/s on "
                  f"{args.threads} threads → {roof['tokens_per_second']:.0f} tokens/s for a batched decode step"
                  + (f"; treadle's {top} streams reach {100 * reached / roof['tokens_per_second']:.0f}% of it"
                     if reached else ""))
        for report in reports.values():
            report["int8_roof"] = roof
    machine = machine_description()
    load = (f"/v1/completions, stream: true; prompts ~{args.prompt_tokens} tokens of synthetic text, "
            f"{args.max_tokens} output tokens each (ignore_eos / min_tokens; transformers: min_new_tokens); "
            f"max(8, 2 × C) requests at each concurrency C in {concurrency}, after "
            f"{args.warmup} warm-up requests; temperature 0; one server at a time, {args.threads} threads each")
    measured = (f"Measured {time.strftime('%Y-%m-%d')} on {machine['cpu']} ({platform.machine()}), "
                f"{machine['cores']} cores, {_memory_gib():.0f} GiB, Linux {platform.release()}, Python "
                f"{platform.python_version()}; a shared machine: the load average beside each server tells how "
                f"quiet it was (the server and the client make about 2.5 themselves).")
    section = [measured, "", table, "", f"Load: {load}.", "", "Servers:", ""]
    for name, cmd in commands.items():
        if name in reports:
            report = reports[name]
            load = report.get("load_average", {})
            when = report.get("finished_at") or report.get("started_at", "")
            during = (f"; 1-minute load average {load['before']:.2f} before, {load['after']:.2f} at the end"
                      if load else "")
            section.append(f"- {name}: `{cmd}` (finished {when.replace('T', ' ')[:16]}{during})")
    section += [f"- {name}: skipped — {why}" for name, why in skipped.items()]
    section += ["", f"Command: `{shlex.join(['.venv/bin/python', 'bench/side_by_side.py', *sys.argv[1:]])}`"]
    if args.plot:
        write_plot(reports, args.plot, title=f"{MODEL} (Q4_1 GGUF), {args.threads} threads, "
                                             f"{args.max_tokens} output tokens per request")
        section += ["", f"![latency and throughput against concurrency]({os.path.relpath(args.plot, 'bench')})"]
    text = "\n".join(section)
    print(text)
    (out / "table.md").write_text(text + "\n")
    if args.update_readme:
        update_readme(Path(args.update_readme), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
