"""The `treadle` command line: serve, generate, chat, pull, models, bench.

Each subcommand imports its module lazily so that `treadle --help` stays instant and a
benchmark of one package does not pay for loading the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from threadpool.numba_cache import use_numba_cache

# `treadle bench NAME ...` runs `main(argv)` of the module named here.
BENCHMARKS = {
    "pool": "bench.pool",
    "kv": "bench.kv",
    "kernels": "bench.kernels",
    "engine": "bench.engine",
    "churn": "bench.churn",
    "synth": "bench.synth",
    "sizes": "bench.sizes",
    "long-decode": "bench.long_decode",
    "batch-decode": "bench.batch_decode",
    "embed": "bench.embed",
    "prefix-tiers": "bench.prefix_tiers",
    "serve": "bench.serve",
    "soak": "bench.soak",
}

# `treadle NAME ...` runs `main(argv)` of the module named here.
COMMANDS = {
    "serve": "app.serve",
    "generate": "app.generate",
    "chat": "app.chat",
    "pull": "app.pull",
    "models": "app.models",
}


def main(argv: list[str] | None = None) -> int:
    # Before any kernel module loads numba: cached kernels live in a directory named after every kernel
    # source, so an edit to one (a checkout moved by `git pull`) never runs a stale caller's inlined copy.
    use_numba_cache()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__)
    parser.add_argument("command", choices=[*COMMANDS, "bench"])
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"usage: treadle bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
            return 2
        module_name, rest = BENCHMARKS[rest[0]], rest[1:]
    elif command in COMMANDS:
        module_name = COMMANDS[command]
    else:
        parser.error(f"unknown command {command!r}")
    module = importlib.import_module(module_name)
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
