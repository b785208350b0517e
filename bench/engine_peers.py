"""`treadle bench engine --peers`: llama.cpp and transformers, each run to its end in its own process
(bench/llama_cpp_peer.py, bench/transformers_peer.py) on the same GGUF and thread count as treadle."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.engine_quality import agreement
from decoding.model.model import Model

REPO = Path(__file__).resolve().parent.parent
# transformers lives in its own venv (`make bench`) so torch never enters .venv.
BENCH_PYTHON = REPO / ".venv-bench" / "bin" / "python"
# transformers' batched decode is taken at one size, treadle's 32-stream level: torch on two cores
# needs a minute or more for each batch size.
TRANSFORMERS_BATCH = 32
PEER_TIMEOUT_S = 1800


def peer_result(peer: str, returncode: int, stdout: str, stderr: str) -> dict:
    """A peer script's report, the JSON on its last stdout line, or why there is none (the tail of its
    stderr, where a traceback ends): a failed peer becomes a line of the report instead of losing the
    treadle figures measured before it."""
    lines = stdout.strip().splitlines()
    if returncode != 0 or not lines:
        return {"skipped": f"{peer} peer failed (exit {returncode}): {stderr.strip()[-300:]}"}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"skipped": f"{peer} peer printed no JSON: {lines[-1][-300:]}"}


def run_peer(peer: str, command: list[str]) -> dict:
    """Runs a peer script to its end: the caller runs peers one after the other, never beside treadle."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PEER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"skipped": f"{peer} peer ran past {PEER_TIMEOUT_S} s"}
    return peer_result(peer, done.returncode, done.stdout, done.stderr)


def run_llama_cpp(model: Model, threads: int, quality: dict | None) -> dict:
    """llama.cpp in its own process on the same GGUF file and thread count (bench/llama_cpp_peer.py)."""
    script = REPO / "bench" / "llama_cpp_peer.py"
    if not script.exists() or model.path.suffix != ".gguf":
        return {"skipped": "needs a checkout with bench/ and a GGUF model"}
    command = [sys.executable, str(script), "--model", str(model.path), "--threads", str(threads)]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as ids_file:
        if quality:
            json.dump(quality["chunks"], ids_file)
            ids_file.flush()
            command += ["--agreement-ids", ids_file.name]
        result = run_peer("llama.cpp", command)
    if quality and "argmax" in result:
        result["top1_agreement_with_exact"] = agreement(result.pop("argmax"), quality["exact_top1"])
    return result


def run_transformers(gguf: Path, model_name: str, threads: int, prompt_ids: list[int], max_tokens: int,
                     prefill_tokens: int, python: Path = BENCH_PYTHON) -> dict:
    """transformers (torch CPU, float32) in .venv-bench's Python on the same weights and thread count, the
    same prompt ids and lengths as treadle's figures (bench/transformers_peer.py)."""
    script = REPO / "bench" / "transformers_peer.py"
    if not script.exists() or gguf.suffix != ".gguf":
        return {"skipped": "needs a checkout with bench/ and a GGUF model"}
    if not python.exists():
        return {"skipped": f"not installed: {python} does not exist; run make bench"}
    hf_dir = REPO / "bench-results" / f"hf-{model_name}"  # the directory bench/side_by_side.py serves
    return run_peer("transformers", [
        str(python), str(script), "--model", str(gguf), "--hf-dir", str(hf_dir), "--threads", str(threads),
        "--prompt-ids", ",".join(map(str, prompt_ids)), "--max-new-tokens", str(max_tokens),
        "--batch-sizes", str(TRANSFORMERS_BATCH), "--prefill-tokens", str(prefill_tokens)])


def run_peers(model: Model, threads: int, quality: dict | None, prompt_ids: list[int], max_tokens: int,
              prefill_tokens: int) -> dict[str, dict]:
    """One peer after the other, so none shares the cores with another (or with treadle)."""
    return {"llama_cpp": run_llama_cpp(model, threads, quality),
            "transformers": run_transformers(model.path, model.name, threads, prompt_ids, max_tokens,
                                             prefill_tokens)}
