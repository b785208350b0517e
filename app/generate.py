"""`treadle generate "PROMPT"`: stream one completion to stdout from the command line."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from decoding import DEFAULT_MODEL, ModelLoadError, TemplateError, load_model
from decoding.detokenizer import IncrementalDetokenizer
from decoding.reference import forward_logits


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
    args = parser.parse_args(argv)
    if args.max_tokens <= 0:
        parser.error("--max-tokens must be positive")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


def _sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.cumsum(probs[order]) - probs[order] < top_p
    kept = order[keep]
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        model = load_model(args.model)
        tok = model.tokenizer
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            text = tok.apply_chat_template([*messages, {"role": "user", "content": args.prompt}])
        else:
            text = args.prompt
    except (ModelLoadError, TemplateError) as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 2
    ids = tok.encode(text, add_special_tokens=True)
    if len(ids) + args.max_tokens > model.config.max_context:
        print(f"treadle: error: prompt ({len(ids)} tokens) + max tokens exceed the context "
              f"({model.config.max_context})", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    detok = IncrementalDetokenizer(tok, ids)
    for _ in range(args.max_tokens):
        token = _sample(forward_logits(model, ids)[-1], args.temperature, args.top_p, rng)
        if token in model.config.eos_token_ids:
            break
        ids.append(token)
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0
