"""`treadle generate "PROMPT"`: stream one completion to stdout from the command line."""

from __future__ import annotations

import argparse
import sys

from decoding import DEFAULT_MODEL, ModelLoadError, TemplateError, load_model
from decoding.engine.engine import Engine, EngineConfig, RequestTooLarge
from decoding.engine.params import InvalidParams, SamplingParams
from decoding.kernels.forward import KERNEL_MODES
from decoding.model.tokenizer import Tokenizer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="treadle generate", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kernels", choices=KERNEL_MODES, default="fast",
                        help="fast: int8 activations (default); exact: float32 activations, reference numerics")
    parser.add_argument("--threads", type=int, default=None, help="pool threads (default: every usable core)")
    args = parser.parse_args(argv)
    if args.max_tokens <= 0:
        parser.error("--max-tokens must be positive")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


def prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool, system: str | None) -> list[int]:
    """The prompt as the server sends it to the engine: with --chat, rendered as /v1/chat/completions
    renders messages (the template writes BOS); otherwise as /v1/completions encodes a prompt."""
    if not chat:
        return tokenizer.encode(prompt, add_special_tokens=True)
    messages = [{"role": "system", "content": system}] if system else []
    return tokenizer.encode_chat([*messages, {"role": "user", "content": prompt}])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        model = load_model(args.model)
        ids = prompt_ids(model.tokenizer, args.prompt, args.chat, args.system)
    except (ModelLoadError, TemplateError) as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 2
    engine = Engine(model, EngineConfig(max_num_seqs=1, n_threads=args.threads, kv_cache_mb=64,
                                        kernels=args.kernels)).start()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        for output in engine.submit(ids, params):
            sys.stdout.write(output.text)
            sys.stdout.flush()
            if output.finish_reason == "error":
                print(f"\ntreadle: error: {output.error}", file=sys.stderr)
                return 1
    except (RequestTooLarge, InvalidParams) as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    return 0
