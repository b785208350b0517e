#!/usr/bin/env python3
"""Stream a chat reply as msgpack: a msgpack request body, and `Accept: application/msgpack` for a
response of consecutive msgpack maps (the same fields as the JSON chunks) ending with {"done": true}.

    treadle serve &
    python examples/msgpack_stream.py "Name three kinds of loom."

msgpack skips JSON's text encoding on both sides; a client reads the stream with msgpack.Unpacker,
which yields each map as soon as its bytes are complete, whatever the chunking of the HTTP body.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
import msgpack

MSGPACK = "application/msgpack"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Explain in two sentences what a treadle does.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    parser.add_argument("--system", default="You are a concise, helpful assistant.", help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token, if the server wants one")
    args = parser.parse_args()

    body = {
        "messages": [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    unpacker = msgpack.Unpacker()
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    with httpx.stream("POST", url, content=msgpack.packb(body), headers=headers, timeout=300) as response:
        if response.status_code != 200:
            error = msgpack.unpackb(response.read()).get("error", {})
            print(f"error {response.status_code}: {error.get('message')}", file=sys.stderr)
            return 1
        for data in response.iter_bytes():
            unpacker.feed(data)
            for chunk in unpacker:
                if chunk.get("done"):
                    print()
                    return 0
                if "error" in chunk:
                    print(f"\nerror: {chunk['error'].get('message')}", file=sys.stderr)
                    return 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    print(f"\n[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens]",
                          file=sys.stderr)
                if chunk.get("choices"):
                    print(chunk["choices"][0]["delta"].get("content") or "", end="", flush=True)
    print("\nerror: the stream ended without {'done': true}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
