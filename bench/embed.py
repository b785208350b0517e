"""`treadle bench embed`: inputs/s and tokens/s of an embedding model, beside sentence-transformers and
llama-server.

    .venv/bin/treadle bench embed [--model all-minilm-l6-v2] [--batches 1,32,256] [--threads 2]
                                  [--kernels fast] [--peer-python .venv-golden/bin/python]
                                  [--gguf MODEL.gguf] [--json PATH]
    .venv/bin/treadle bench embed --model qwen2.5-coder-0.5b-instruct [--pooling last]

The inputs are texts of 16..128 tokens (seeded; words drawn from the golden sentences), the same for
every engine. Batch 1 is one request per input (the latency a retrieval query sees); batch N is one
request of N inputs. Three ways of running the same weights, one after another (never sharing cores):

- treadle in-process (its EmbeddingEngine on the pool), and `treadle serve` through /v1/embeddings;
- sentence-transformers on torch with the same threads, run by `--peer-python` (an environment with
  torch and sentence-transformers: `make golden` builds .venv-golden) in a subprocess, so torch never
  enters treadle's environment;
- with `--gguf` (the model converted by llama.cpp's convert_hf_to_gguf.py), llama-server `--embedding`
  through the same /v1/embeddings client (scripts/build_llama_server.sh builds it).

A generation model's GGUF (`--model` a decoder) is benchmarked as an embedder (`--task embed`, `--pooling`):
in process, served, served with `--task generate,embed` (the inputs in the generation engine's steps), and
llama-server `--embedding` on the same file; sentence-transformers has no part (it does not read GGUF).

Each figure is the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.servers import free_port, stop, wait_until_ready
from bench.side_by_side import llama_server_binary
from decoding.engine.config import EngineConfig
from decoding.engine.embedding import EmbeddingEngine
from decoding.kernels.forward import KERNEL_MODES
from decoding.model.decoder_embedder import DecoderEmbedder, decoder_embedder
from decoding.model.encoder import EncoderModel
from decoding.model.model import Model
from decoding.model.registry import load_any_model

REPO = Path(__file__).resolve().parent.parent
WORDS_FROM = REPO / "tests" / "golden" / "embeddings" / "all-minilm-l6-v2.json"

# Run by the peer's python: times sentence-transformers on the same texts and batches, prints JSON.
PEER_SCRIPT = """
import json, statistics, sys, time
import torch
from sentence_transformers import SentenceTransformer
spec = json.load(sys.stdin)
torch.set_num_threads(spec["threads"])
model = SentenceTransformer(spec["model_dir"], device="cpu")
texts = spec["texts"]
model.encode(texts[:8])
out = {}
for batch in spec["batches"]:
    runs = []
    for _ in range(spec["repeats"]):
        started = time.perf_counter()
        if batch == 1:
            for text in texts[: spec["single_requests"]]:
                model.encode([text], batch_size=1)
            runs.append((time.perf_counter() - started) / spec["single_requests"])
        else:
            model.encode(texts[:batch], batch_size=32)
            runs.append(time.perf_counter() - started)
    out[str(batch)] = statistics.median(runs)
print(json.dumps({"seconds": out, "torch": torch.__version__, "threads": torch.get_num_threads()}))
"""


def bench_texts(model: EncoderModel | DecoderEmbedder, count: int, seed: int = 0) -> list[str]:
    """`count` texts of 16..128 tokens each, built from the words of the golden sentences."""
    words = " ".join(json.loads(WORDS_FROM.read_text(encoding="utf-8"))["sentences"][:20]).split()
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        target = int(rng.integers(16, 129))
        chosen: list[str] = []
        while len(model.tokenizer.encode(" ".join(chosen))[0]) < target:
            chosen.append(words[int(rng.integers(len(words)))])
        texts.append(" ".join(chosen))
    return texts


def time_treadle(engine: EmbeddingEngine, inputs: list[tuple[list[int], list[int]]], batch: int, repeats: int,
                 single_requests: int) -> float:  # fmt: skip
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        if batch == 1:
            for item in inputs[:single_requests]:
                engine.encode([item])
            runs.append((time.perf_counter() - started) / single_requests)
        else:
            engine.encode(inputs[:batch])
            runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def time_peer(python: str, model_dir: Path, texts: list[str], batches: list[int], threads: int, repeats: int,
              single_requests: int) -> dict[str, Any] | None:  # fmt: skip
    spec = {"model_dir": str(model_dir), "texts": texts, "batches": batches, "threads": threads, "repeats": repeats,
            "single_requests": single_requests}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, "-c", PEER_SCRIPT], input=json.dumps(spec), capture_output=True, text=True,
                          env=env, check=False)  # fmt: skip
    if done.returncode != 0:
        print(f"sentence-transformers peer failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def time_server(base_url: str, texts: list[str], batches: list[int], repeats: int,
                single_requests: int) -> dict[int, float]:  # fmt: skip
    """Median seconds per request of each batch size through POST /v1/embeddings (floats, one client)."""
    url = base_url + "/v1/embeddings"
    seconds: dict[int, float] = {}
    with httpx.Client(timeout=600) as client:
        client.post(url, json={"input": texts[:8]}).raise_for_status()
        for batch in batches:
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                if batch == 1:
                    for text in texts[:single_requests]:
                        client.post(url, json={"input": [text], "encoding_format": "float"}).raise_for_status()
                    runs.append((time.perf_counter() - started) / single_requests)
                else:
                    answer = client.post(url, json={"input": texts[:batch], "encoding_format": "float"})
                    answer.raise_for_status()
                    assert len(answer.json()["data"]) == batch
                    runs.append(time.perf_counter() - started)
            seconds[batch] = statistics.median(runs)
    return seconds


def serve_and_time(command: list[str], texts: list[str], batches: list[int], repeats: int,
                   single_requests: int) -> dict[int, float] | None:  # fmt: skip
    """Start a server (`command` with a port appended by its flag), time it, stop it."""
    port = free_port()
    # the log goes to a file: a pipe nobody reads fills up, and llama-server then blocks writing its next line
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            failure = wait_until_ready(process, f"http://127.0.0.1:{port}/health", timeout_s=600)
            if failure is not None:
                log.seek(0)
                print(f"{command[0]} did not start: {failure}\n{log.read()[-2000:].decode(errors='replace')}",
                      file=sys.stderr)
                return None
            return time_server(f"http://127.0.0.1:{port}", texts, batches, repeats, single_requests)
        finally:
            stop(process)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench embed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kernels", choices=KERNEL_MODES, default="fast")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-requests", type=int, default=32, help="requests timed at batch 1")
    default_peer = REPO / ".venv-golden" / "bin" / "python"
    parser.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else "",
                        help="a python with torch and sentence-transformers ('' skips the peer)")
    parser.add_argument("--gguf", type=Path, help="the model converted by llama.cpp, for llama-server --embedding")
    parser.add_argument("--pooling", choices=("last", "mean", "cls"), default="last",
                        help="how a generation model (--model a decoder) is pooled")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    loaded = load_any_model(args.model)
    model = decoder_embedder(loaded, args.pooling, True, 8192) if isinstance(loaded, Model) else loaded
    decoder = isinstance(loaded, Model)
    if decoder:
        args.gguf = args.gguf or (loaded.path if loaded.path.suffix == ".gguf" else None)
        args.peer_python = ""  # sentence-transformers does not read a GGUF
    texts = bench_texts(model, max(max(batches), args.single_requests))
    inputs = [model.tokenizer.encode(text) for text in texts]
    engine = EmbeddingEngine(model, EngineConfig(kernels=args.kernels, n_threads=args.threads)).start()
    try:
        engine.encode(inputs[:8])  # compiles
        treadle = {b: time_treadle(engine, inputs, b, args.repeats, args.single_requests) for b in batches}
    finally:
        engine.shutdown()
    serve = [sys.executable, "-m", "app.cli", "serve", "--model", str(model.path), "--threads", str(args.threads),
             "--kernels", args.kernels, "--max-queue", "1024"]
    as_embedder = ["--task", "embed", "--pooling", args.pooling] if decoder else []
    served = serve_and_time([*serve, *as_embedder], texts, batches, args.repeats, args.single_requests)
    # without prefix caching: a repeat would find its inputs' blocks from the last one (last-token pooling)
    shared = (serve_and_time([*serve, "--task", "generate,embed", "--pooling", args.pooling,
                              "--no-enable-prefix-caching"], texts, batches, args.repeats,
                             args.single_requests) if decoder else None)  # fmt: skip
    peer = (time_peer(args.peer_python, model.path, texts, batches, args.threads, args.repeats,
                      args.single_requests) if args.peer_python else None)  # fmt: skip
    llama = None
    if args.gguf is not None:
        binary = llama_server_binary()
        if binary is None:
            print("llama-server is not built (scripts/build_llama_server.sh): skipped", file=sys.stderr)
        else:
            slots, per_slot = 32, min(model.config.max_positions, 512)  # the inputs have at most 128 tokens
            llama = serve_and_time([str(binary), "--model", str(args.gguf), "--embedding", "--pooling",
                                    model.config.pooling, "--threads", str(args.threads), "--threads-batch",
                                    str(args.threads), "--parallel", str(slots), "--ctx-size",
                                    str(slots * per_slot), "--batch-size", "4096",
                                    "--ubatch-size", "4096", "--host", "127.0.0.1"],
                                   texts, batches, args.repeats, args.single_requests)  # fmt: skip

    rows = []
    for batch in batches:
        n = 1 if batch == 1 else batch
        tokens = (sum(len(ids) for ids, _ in inputs[: args.single_requests]) / args.single_requests if batch == 1
                  else sum(len(ids) for ids, _ in inputs[:batch]))  # fmt: skip
        row: dict[str, Any] = {"batch": batch, "tokens": tokens, "treadle_inputs_per_s": n / treadle[batch],
                               "treadle_tokens_per_s": tokens / treadle[batch]}
        if served is not None:
            row["served_inputs_per_s"] = n / served[batch]
        if shared is not None:
            row["served_beside_generation_inputs_per_s"] = n / shared[batch]
        if llama is not None:
            row["llama_server_inputs_per_s"] = n / llama[batch]
            if served is not None:
                row["ratio_llama_server"] = llama[batch] / served[batch]
        if peer is not None:
            seconds = peer["seconds"][str(batch)]
            row.update(st_inputs_per_s=n / seconds, st_tokens_per_s=tokens / seconds,
                       ratio=seconds / treadle[batch])
        rows.append(row)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    print(f"{model.name}: {model.config.n_layers} layers, dim {model.config.dim}; {args.threads} threads of {cpu}; "
          f"treadle --kernels {args.kernels}" + (f"; sentence-transformers on torch {peer['torch']}" if peer else ""))
    header = f"{'batch':>6} {'tokens':>8} {'treadle in/s':>13} {'tok/s':>9}"
    if peer is not None:
        header += f" {'s-t in/s':>10} {'tok/s':>9} {'ratio':>6}"
    if served is not None:
        header += f" {'served in/s':>12}"
    if shared is not None:
        header += f" {'generate,embed':>15}"
    if llama is not None:
        header += f" {'llama-server in/s':>18} {'ratio':>6}"
    print(header)
    for row in rows:
        line = (f"{row['batch']:>6} {row['tokens']:>8.0f} {row['treadle_inputs_per_s']:>13.1f} "
                f"{row['treadle_tokens_per_s']:>9.0f}")  # fmt: skip
        if peer is not None:
            line += f" {row['st_inputs_per_s']:>10.1f} {row['st_tokens_per_s']:>9.0f} {row['ratio']:>5.2f}x"
        if served is not None:
            line += f" {row['served_inputs_per_s']:>12.1f}"
        if shared is not None:
            line += f" {row['served_beside_generation_inputs_per_s']:>15.1f}"
        if llama is not None:
            line += f" {row['llama_server_inputs_per_s']:>18.1f} {row.get('ratio_llama_server', 0):>5.2f}x"
        print(line)
    print("ratio: the peer's time over treadle's (in-process for sentence-transformers, served for llama-server)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "treadle bench embed " + " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpu": cpu, "threads": args.threads, "model": model.name, "kernels": args.kernels, "rows": rows,
            "peer": None if peer is None else {"name": "sentence-transformers", "torch": peer["torch"]},
            "gguf": None if args.gguf is None else str(args.gguf),
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
