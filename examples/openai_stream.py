#!/usr/bin/env python3
"""Stream a chat reply with the official `openai` package, printing tokens as they arrive.

    treadle serve &                      # http://127.0.0.1:8000
    python examples/openai_stream.py "Write a haiku about looms."
    python examples/openai_stream.py --base-url http://127.0.0.1:8000 --system "Answer in French." "Hello!"

Works unchanged against any OpenAI-compatible server (vLLM, llama.cpp's llama-server, ...):
only `base_url` changes. Token usage goes to stderr at the end (`stream_options.include_usage`).
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Explain in two sentences what a treadle does.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    parser.add_argument("--system", default="You are a concise, helpful assistant.", help="system prompt")
    parser.add_argument("--model", help="model name (default: the server's first model)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                        help="sent as a bearer token (default: $OPENAI_API_KEY; treadle needs one only with --api-key)")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:  # the last chunk: empty choices, usage set
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]",
                  file=sys.stderr)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
