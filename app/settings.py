"""`treadle serve` options: each flag also reads a `TREADLE_*` environment variable (flag wins)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from decoding import DEFAULT_MODEL
from decoding.engine.config import SPECULATIVE_MODES
from decoding.engine.engine import KV_CACHE_DTYPES, EngineConfig
from decoding.kernels.forward import KERNEL_MODES

ENV_PREFIX = "TREADLE_"
_ENGINE_DEFAULTS = EngineConfig()


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model: str = DEFAULT_MODEL
    served_model_name: tuple[str, ...] = ()  # names requests may give; the first is reported. (): the model's
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None  # None: every usable core
    max_num_seqs: int = _ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _ENGINE_DEFAULTS.max_num_batched_tokens
    kv_cache_mb: float | str = _ENGINE_DEFAULTS.kv_cache_mb  # or "auto"
    block_size: int = _ENGINE_DEFAULTS.block_size
    kernels: str = _ENGINE_DEFAULTS.kernels
    kv_cache_dtype: str = _ENGINE_DEFAULTS.kv_cache_dtype
    weight_cache: bool = _ENGINE_DEFAULTS.weight_cache
    max_queue: int = _ENGINE_DEFAULTS.max_queue  # running + waiting + being tokenized; more get 429
    api_key: str | None = None
    cors_origins: tuple[str, ...] = field(default_factory=tuple)
    max_body_bytes: int = 4 * 1024 * 1024
    sse_ping_seconds: float = 15.0  # below the 60 s idle timeout of common proxies
    max_unread_bytes: int = _ENGINE_DEFAULTS.max_unread_bytes or 1 << 20
    slow_reader_timeout_seconds: float = _ENGINE_DEFAULTS.slow_reader_timeout_seconds
    shutdown_grace_seconds: float = 20.0  # below Kubernetes' default 30 s before SIGKILL
    log_level: str = "info"
    chat_page: bool = True  # examples/chat.html at GET /
    speculative: str = _ENGINE_DEFAULTS.speculative
    speculative_max_tokens: int = _ENGINE_DEFAULTS.speculative_max_tokens
    priority_header: str | None = None  # a header that gives `priority` when the body does not
    priority_starvation_seconds: float = _ENGINE_DEFAULTS.priority_starvation_seconds or 60.0
    # a request's `timeout` when it gives none; None: wait as long as it takes
    queue_timeout_seconds: float | None = None
    stream_grace_seconds: float = 30.0  # a stream whose client left is paused this long for a reconnect
    stream_resume_bytes: int = 4 << 20  # of one stream's events kept for a reconnect; older sent ones are dropped
    responses_store_seconds: float = 3600.0  # how long a finished stored response stays retrievable
    responses_store_max: int = 1000  # stored responses kept at most (the oldest go first)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            kv_cache_mb=self.kv_cache_mb, block_size=self.block_size, max_queue=self.max_queue,
                            n_threads=self.threads, kernels=self.kernels, kv_cache_dtype=self.kv_cache_dtype,
                            weight_cache=self.weight_cache,
                            max_unread_bytes=self.max_unread_bytes,
                            slow_reader_timeout_seconds=self.slow_reader_timeout_seconds,
                            speculative=self.speculative, speculative_max_tokens=self.speculative_max_tokens,
                            priority_starvation_seconds=self.priority_starvation_seconds)


@dataclass(frozen=True, slots=True)
class RayOptions:
    """`treadle serve --ray`: replicas behind Ray Serve's HTTP proxy (the `ray` extra; docs/scaling.md)."""

    replicas: int = 2
    threads_per_replica: int = 1  # each replica's pool; the replica's --threads
    prefix_affinity: bool = True  # route by the longest shared prompt prefix while the replicas are balanced
    ray_address: str | None = None  # an existing cluster; None starts one in this process


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _kv_cache_mb(text: str) -> float | str:
    return "auto" if text == "auto" else _positive_float(text)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def _kernels(text: str) -> str:
    if text not in KERNEL_MODES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(KERNEL_MODES)}, got {text!r}")
    return text


def _kv_cache_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {text!r}")
    return text


def _speculative(text: str) -> str:
    if text not in SPECULATIVE_MODES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(SPECULATIVE_MODES)}, got {text!r}")
    return text


def _draft_length(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"must be between 1 and 16, got {value}")
    return value


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise SystemExit(f"treadle serve: error: {name} must be 1/0, true/false, yes/no or on/off, got {value!r}")


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def env_var(flag: str) -> str:
    """`--max-num-seqs` reads `TREADLE_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def build_parser(prog: str = "treadle serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve the OpenAI-compatible API over HTTP.",
                                     epilog="Every option can also be set with the environment variable named "
                                            "in brackets; a flag on the command line wins.")
    defaults = ServerSettings()

    def option(flag: str, type_: Callable[[str], object], default: object, help_: str,
               group: argparse._ActionsContainer = parser) -> None:
        name = env_var(flag)
        # argparse converts a string default with `type`, so a bad env value fails like a bad flag.
        group.add_argument(flag, type=type_, default=os.environ.get(name, default), help=f"{help_} [{name}]")

    option("--model", str, defaults.model, "registered model name, .gguf file or Hugging Face directory "
                                           "(default %(default)s)")
    name = env_var("--served-model-name")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME", type=str,
                        default=tuple(os.environ.get(name, "").split()),
                        help="the names requests may give in `model` (vLLM's option): /v1/models lists them and "
                             "responses report the first; any other name gets 404 (default: the model's own "
                             f"name) [{name}, space-separated]")
    option("--host", str, defaults.host, "address to listen on (default %(default)s)")
    option("--port", _port, defaults.port, "TCP port (default %(default)s)")
    option("--threads", _positive_int, None, "engine pool threads (default: every usable core)")
    option("--max-num-seqs", _positive_int, defaults.max_num_seqs, "sequences decoded together (default %(default)s)")
    option("--max-num-batched-tokens", _positive_int, defaults.max_num_batched_tokens,
           "tokens per engine step (default %(default)s)")
    option("--kv-cache-mb", _kv_cache_mb, defaults.kv_cache_mb,
           "KV cache size in MiB, or auto: half of the memory available beyond the weights and a margin (the log "
           "says what it chose); a size that does not fit beside the weights is refused at start "
           "(default %(default)s)")
    option("--block-size", _positive_int, defaults.block_size, "tokens per KV block (default %(default)s)")
    option("--kernels", _kernels, defaults.kernels,
           "fast: int8 activations, VNNI dot products (llama.cpp-like numerics); exact: float32 activations, "
           "logits within 1e-3 of the reference (default %(default)s)")
    option("--kv-cache-dtype", _kv_cache_dtype, defaults.kv_cache_dtype,
           "stored type of the KV cache: float16 halves its bytes per token (twice the tokens per MiB, half "
           "the reads per decode), float32 keeps exact attention inputs, int8 (llama.cpp's q8_0 cache: a fp16 "
           "scale per 32 values) takes 53%% of float16's bytes; auto: float16 with the fast kernels, float32 "
           "with the exact ones (default %(default)s)")
    name = env_var("--no-weight-cache")
    parser.add_argument("--no-weight-cache", dest="weight_cache", action="store_false",
                        default=os.environ.get(name, "").lower() not in ("1", "true", "yes"),
                        help="repack the fast kernels' weights at every start instead of mapping them from the "
                             f"weight cache, a file per model written at its first start [{name}=1]")
    option("--speculative", _speculative, defaults.speculative,
           "speculative decoding with drafts from the context (n-grams of the prompt and the answer so far; the "
           "output stays what plain decoding gives): auto drafts while the measured step costs say it pays, "
           "ngram always, off never (default %(default)s)")
    option("--speculative-max-tokens", _draft_length, defaults.speculative_max_tokens,
           "the longest draft a sequence verifies in one step (default %(default)s)")
    option("--max-queue", _positive_int, defaults.max_queue,
           "requests admitted at once (running + waiting); more are answered 429 (default %(default)s)")
    option("--api-key", str, None, "require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize")
    option("--cors-origins", _origins, "", "comma-separated origins allowed by CORS, or * (default: none)")
    option("--max-body-bytes", _positive_int, defaults.max_body_bytes,
           "largest request body; larger ones get 413 (default %(default)s)")
    option("--sse-ping-seconds", _positive_float, defaults.sse_ping_seconds,
           "interval of SSE comment pings that keep idle streams open through proxies (default %(default)s)")
    option("--max-unread-bytes", _positive_int, defaults.max_unread_bytes,
           "output a request may hold unread by its client; past it the request pauses (keeping its KV) "
           "until the client reads (default %(default)s)")
    option("--slow-reader-timeout-seconds", _positive_float, defaults.slow_reader_timeout_seconds,
           "a request paused this long for its client is aborted, and a stream write blocked this long "
           "ends the connection (default %(default)s)")
    option("--shutdown-grace-seconds", _non_negative_float, defaults.shutdown_grace_seconds,
           "on SIGTERM or SIGINT, how long requests in flight may run on before their streams are ended with "
           "an error event; new requests get 503 meanwhile (default %(default)s)")
    option("--priority-header", str, None,
           "read a request's `priority` from this header when its body gives none, for front ends that cannot add "
           "fields (an integer; lower is served first)")
    option("--priority-starvation-seconds", _positive_float, defaults.priority_starvation_seconds,
           "a request that has waited this long for admission goes ahead of every priority, in arrival order, so "
           "a low priority delays a request but never starves it (default %(default)s)")
    option("--queue-timeout-seconds", _positive_float, None,
           "the default `timeout` of a request: one still waiting for admission past it is answered 503 with "
           "Retry-After (an error event if its stream has begun) instead of being served late (default: none)")
    option("--stream-grace-seconds", _non_negative_float, defaults.stream_grace_seconds,
           "a stream whose client disconnects is paused (its KV kept) this long, so that the client can reconnect "
           "(GET /v1/chat/completions/ID/stream with Last-Event-ID), resume it and lose nothing; 0 aborts it at once "
           "(default %(default)s)")
    option("--stream-resume-bytes", _positive_int, defaults.stream_resume_bytes,
           "events of one stream kept for a reconnect; past it the oldest events already sent are dropped "
           "(default %(default)s)")
    option("--responses-store-seconds", _positive_float, defaults.responses_store_seconds,
           "how long a finished response created with store: true stays retrievable (default %(default)s)")
    option("--responses-store-max", _positive_int, defaults.responses_store_max,
           "stored responses kept at most, in memory; the oldest finished ones go first (default %(default)s)")
    parser.add_argument("--no-chat-page", dest="chat_page", action="store_false",
                        default=_env_flag(env_var("--chat-page"), defaults.chat_page),
                        help="do not serve the browser chat page (examples/chat.html) at / [TREADLE_CHAT_PAGE=0]")
    option("--log-level", str.lower, defaults.log_level,
           "critical, error, warning, info or debug (default %(default)s)")
    add_ray_options(parser, option)
    return parser


def add_ray_options(parser: argparse.ArgumentParser, option: Callable[..., None]) -> None:
    ray = parser.add_argument_group("Ray Serve (the `ray` extra)",
                                    "Run --replicas treadle replicas behind Ray Serve's HTTP proxy on --host/--port; "
                                    "each takes every option above, with --threads-per-replica for --threads "
                                    "(docs/scaling.md).")
    defaults = RayOptions()
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve instead of one process")
    option("--replicas", _positive_int, defaults.replicas, "engine replicas (default %(default)s)", ray)
    option("--threads-per-replica", _positive_int, defaults.threads_per_replica,
           "pool threads of each replica, pinned to its own cores (default %(default)s)", ray)
    ray.add_argument("--no-prefix-affinity", dest="prefix_affinity", action="store_false",
                     help="route by load alone (power of two choices), not to the replica holding the prompt's "
                          "prefix")
    ray.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"),
                     help="an existing Ray cluster (default: start one in this process) [RAY_ADDRESS]")


def parse_settings(argv: list[str]) -> ServerSettings:
    return parse_serve_args(argv)[0]


def parse_serve_args(argv: list[str]) -> tuple[ServerSettings, RayOptions | None]:
    """The settings, and the Ray Serve options if `--ray` was given."""
    parser = build_parser()
    args = parser.parse_args(argv)
    ray = RayOptions(**{f: getattr(args, f) for f in RayOptions.__slots__}) if args.ray else None
    for name in ("ray", *RayOptions.__slots__):
        delattr(args, name)
    if args.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
        parser.error(f"unknown --log-level {args.log_level!r}")
    usable_cores = len(os.sched_getaffinity(0))
    if args.threads is not None and args.threads > usable_cores:
        parser.error(f"--threads {args.threads} is more than the {usable_cores} usable cores: the pool's threads "
                     "spin, and two sharing a core wait out each other's time slices at every barrier")
    args.served_model_name = tuple(args.served_model_name)
    return ServerSettings(**vars(args)), ray
