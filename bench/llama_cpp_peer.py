#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python) in process on a GGUF: decode and prompt speed, and top-1 logits.

    python bench/llama_cpp_peer.py --model FILE.gguf --threads 2 [--agreement-ids ids.json] > result.json

Prints JSON: single-stream decode tokens/s (greedy, `--decode-tokens` new tokens after a short prompt),
prompt processing tokens/s (`--prompt-tokens`), and, with --agreement-ids (a JSON list of token-id
lists), llama.cpp's argmax at every position, for `treadle bench engine` to compare with treadle's.
Run by `treadle bench engine --peers` in its own process, so the two never share cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--agreement-ids", default=None)
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError as exc:
        print(json.dumps({"skipped": f"llama-cpp-python is not installed ({exc})"}))
        return 0
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=4096, n_batch=512, logits_all=args.agreement_ids is not None, verbose=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, llm.n_vocab(), args.prompt_tokens).tolist()
    # Warm up as treadle's engine is warmed before it is timed: the first evaluation faults the mapped
    # file's pages in and sizes llama.cpp's buffers, which would otherwise count as prompt time.
    llm.reset()
    llm.eval(prompt[:64])
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    prompt_seconds = time.perf_counter() - started

    llm.reset()
    llm.eval(prompt[:40])
    started = time.perf_counter()
    for _ in range(args.decode_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    decode_seconds = time.perf_counter() - started

    result = {"llama_cpp_version": llama_cpp.__version__, "threads": args.threads,
              "decode_tokens_per_second": args.decode_tokens / decode_seconds,
              "prompt_tokens_per_second": args.prompt_tokens / prompt_seconds}
    if args.agreement_ids:
        argmax = []
        for ids in json.load(open(args.agreement_ids)):
            llm.reset()
            llm.eval(ids)
            argmax.append(np.argmax(llm.scores[: len(ids)], axis=1).tolist())
        result["argmax"] = argmax
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
