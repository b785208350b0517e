#!/usr/bin/env python3
"""transformers (eager PyTorch on the CPU, float32) on the same weights: decode alone and batched, prompt speed.

    .venv-bench/bin/python bench/transformers_peer.py --model FILE.gguf --hf-dir DIR --threads 2 \\
        --prompt-ids 1,2,3 [--max-new-tokens 128] [--batch-sizes 32] [--prefill-tokens 512] > result.json

Run by `treadle bench engine --peers` in its own process after treadle's measurements, so the two never
share cores; it runs in .venv-bench (made by `make bench`) so torch never enters .venv. DIR is the GGUF
dequantized to float32 by transformers' own loader (bench/gguf_to_hf.py, run here if DIR has no
config.json), the directory bench/side_by_side.py serves too: transformers' GGUF loading path
dequantizes to the same float32 tensors at every load, only slower.

Every figure is greedy, under torch.inference_mode(), with torch.set_num_threads(--threads) and
OMP_NUM_THREADS / MKL_NUM_THREADS set before torch is imported:

  * decode tokens/s: one `generate` call on the prompt with max_new_tokens = min_new_tokens = N + 1
    (min_new_tokens so EOS cannot end it early). A logits processor stamps the clock each time
    `generate` has fresh logits: the first stamp follows the prompt's forward, the (N + 1)-th follows
    the N-th single-token forward, so N / (stamp[N] - stamp[0]) is the decode rate of generate's own
    loop (forward, greedy pick, cache update), the prompt's forward excluded. N is --max-new-tokens.
  * batched tokens/s at each of --batch-sizes B: the same, with the prompt repeated B times (no
    padding needed), aggregate = B * N / (stamp[N] - stamp[0]).
  * prompt tokens/s: one forward over --prefill-tokens random token ids (the same draw as treadle's
    prefill measurement), with a fresh KV cache and only the last position's logits, as the first
    step of `generate` does.

Prints one JSON object on stdout, or {"skipped": reason} when torch or transformers is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help="the GGUF file (converted to --hf-dir if that is empty)"
    )
    parser.add_argument("--hf-dir", required=True, help="the GGUF dequantized to a Hugging Face directory")
    parser.add_argument("--threads", type=int, default=2)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt-ids", help="comma-separated token ids (treadle's tokenization of its prompt)"
    )
    prompt.add_argument("--prompt", help="prompt text, tokenized with the model's tokenizer")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="decode steps timed per run")
    parser.add_argument("--batch-sizes", default="32", help="comma-separated; empty skips batched decode")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    return parser.parse_args(argv)


class ClockStamps:
    """A logits processor that only reads the clock: `generate` calls it once per step of its loop,
    right after that step's forward."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def decode_seconds(model: Any, prompt: list[int], batch: int, new_tokens: int) -> float:
    """Seconds `generate` spends on `new_tokens` single-token steps of `batch` copies of `prompt`, the
    prompt's forward excluded (see the module docstring)."""
    import torch  # already imported by main, after the thread environment was set
    from transformers import LogitsProcessorList

    stamps = ClockStamps()
    input_ids = torch.tensor([prompt] * batch)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=new_tokens + 1,
        min_new_tokens=new_tokens + 1,
        logits_processor=LogitsProcessorList([stamps]),
        pad_token_id=model.config.eos_token_id,
    )
    expected = (batch, len(prompt) + new_tokens + 1)
    if tuple(out.shape) != expected or len(stamps.times) != new_tokens + 1:
        raise RuntimeError(
            f"generate made {tuple(out.shape)} tokens in {len(stamps.times)} steps, "
            f"not {expected} in {new_tokens + 1}"
        )
    return stamps.times[new_tokens] - stamps.times[0]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # Read by torch's OpenMP and MKL when torch is imported, so set before the import below.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    try:
        import numpy as np
        import torch
        import transformers
    except ImportError as exc:
        print(json.dumps({"skipped": f"not installed: {exc} in .venv-bench; run make bench"}))
        return 0
    torch.set_num_threads(args.threads)

    hf_dir = Path(args.hf_dir)
    if not (hf_dir / "config.json").exists():
        converter = Path(__file__).resolve().parent / "gguf_to_hf.py"
        subprocess.run(
            [sys.executable, str(converter), args.model, str(hf_dir)], check=True, stdout=sys.stderr
        )
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    load_seconds = time.perf_counter() - started
    if args.prompt_ids:
        prompt = [int(i) for i in args.prompt_ids.split(",")]
    else:
        prompt = transformers.AutoTokenizer.from_pretrained(hf_dir).encode(args.prompt)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    with torch.inference_mode():
        decode_seconds(model, prompt, 1, 4)  # warm-up: first-call allocations and kernel selection
        single = decode_seconds(model, prompt, 1, args.max_new_tokens)
        batched = {b: decode_seconds(model, prompt, b, args.max_new_tokens) for b in batch_sizes}
        # The same draw as `treadle bench engine`'s measure_prefill, so both read the same prompt.
        ids = np.random.default_rng(0).integers(100, model.config.vocab_size, args.prefill_tokens).tolist()
        started = time.perf_counter()
        model(torch.tensor([ids]), logits_to_keep=1)
        prefill_seconds = time.perf_counter() - started

    result = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "load_seconds": load_seconds,
        "prompt_tokens": len(prompt),
        "max_new_tokens": args.max_new_tokens,
        "decode_tokens_per_second": args.max_new_tokens / single,
        "batched_tokens_per_second": {str(b): b * args.max_new_tokens / s for b, s in batched.items()},
        "prompt_tokens_per_second": args.prefill_tokens / prefill_seconds,
        "prefill_tokens": args.prefill_tokens,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
