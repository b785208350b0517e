"""`treadle chat`: an interactive chat in the terminal with an in-process engine.

Replies stream as they are generated; the conversation is kept and re-sent each turn (the prefix
cache makes that cheap). `/reset` starts over, `/exit` or end of input (Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from decoding import DEFAULT_MODEL, ModelLoadError, TemplateError, load_model
from decoding.engine.engine import Engine, EngineConfig, RequestTooLarge
from decoding.engine.params import InvalidParams, SamplingParams
from decoding.kernels.forward import KERNEL_MODES


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="treadle chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kernels", choices=KERNEL_MODES, default="fast",
                        help="fast: int8 activations (default); exact: float32 activations, reference numerics")
    parser.add_argument("--system", default=None, help="system message (default: the template's own)")
    parser.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="pool threads (default: every usable core)")
    return parser.parse_args(argv)


def chat_loop(engine: Engine, params: SamplingParams, system: str | None, stdin: TextIO, stdout: TextIO) -> None:
    tokenizer = engine.model.tokenizer
    initial = [{"role": "system", "content": system}] if system else []
    messages = list(initial)
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":  # EOF or /exit
            stdout.write("\n" if not line else "")
            return
        if line.strip() == "/reset":
            messages = list(initial)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenizer.encode_chat(messages)
        try:
            stream = engine.submit(ids, params)
        except RequestTooLarge:
            stdout.write("(the conversation no longer fits the context: /reset to start over)\n")
            messages.pop()
            continue
        reply = []
        for output in stream:
            stdout.write(output.text)
            stdout.flush()
            reply.append(output.text)
        stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        print(f"treadle: loading {args.model} ...", file=sys.stderr, flush=True)
        model = load_model(args.model)
        model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # fails early without a template
    except (ModelLoadError, TemplateError, InvalidParams) as exc:
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 2
    engine = Engine(model, EngineConfig(max_num_seqs=1, n_threads=args.threads, kv_cache_mb=128,
                                        kernels=args.kernels)).start()
    print("treadle: type a message; /reset starts over, /exit or Ctrl-D quits", file=sys.stderr, flush=True)
    try:
        chat_loop(engine, params, args.system, sys.stdin, sys.stdout)
    finally:
        engine.shutdown()
    return 0
