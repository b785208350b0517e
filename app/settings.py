"""`treadle serve` options, built from their declarations: the server's here, the engine's in
decoding/engine/config.py. Each flag also reads a `TREADLE_*` environment variable (a flag wins), and
docs/serving.md's option table is `options_table()` (scripts/options_table.py writes it)."""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, dataclass, field
from typing import Any

from decoding import DEFAULT_MODEL
from decoding.engine.config import EngineConfig
from decoding.engine.options import (
    OptionSpec,
    comma_list,
    default_of,
    flag_of,
    non_negative_float,
    non_negative_int,
    one_of,
    option,
    option_fields,
    or_none,
    port,
    positive_float,
    positive_int,
    switch,
)

from .reasoning import PARSERS, reasoning_config, template_kwargs
from .tool_syntaxes import TOOL_CALL_PARSERS

ENV_PREFIX = "TREADLE_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model: str = option(DEFAULT_MODEL, "registered model name, .gguf file or Hugging Face directory")
    task: str = option(
        "auto", "what the model is served for: `generate`, `embed` (a generation model's pooled hidden states on "
        "/v1/embeddings, as Qwen3-Embedding and e5-mistral are served), `generate,embed` (both: embedding "
        "inputs share the generation's steps), or `rerank` (a generation model scoring (query, document) pairs "
        "by its yes/no logits on /v1/rerank and /v1/score, as Qwen3-Reranker is served); `auto`: an encoder "
        "(BERT) and a file that declares a pooling (GGUF's pooling_type, sentence-transformers' modules) embed "
        "or rerank as it says, a Qwen3-Reranker directory reranks, anything else generates",
        one_of(("auto", "generate", "embed", "generate,embed", "rerank")))  # fmt: skip
    pooling: str = option(
        "auto", "how `--task embed` (and `generate,embed`) pools a generation model's final hidden states: `last` "
        "(the last token's: Qwen3-Embedding), `mean`, or `cls` (the first token's); `auto`: what the file "
        "declares, else `last`",
        one_of(("auto", "last", "mean", "cls")))  # fmt: skip
    served_model_name: tuple[str, ...] = option(
        (), "the names a request may give in `model` (vLLM's option): /v1/models lists them, responses report "
        "the first, any other name gets 404", many=True, doc_default="the model's name")  # fmt: skip
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "TCP port", port)
    engine: EngineConfig = field(default_factory=EngineConfig)  # its options come here on the command line
    api_key: str | None = option(None, "require `Authorization: Bearer KEY` (the scheme in any case) on /v1/*, "
                                       "/tokenize and /detokenize")  # fmt: skip
    cors_origins: tuple[str, ...] = option((), "comma-separated origins (or *) allowed by CORS", comma_list,
                                           doc_default="none")
    max_body_bytes: int = option(4 * 1024 * 1024, "largest request body; larger ones get 413", positive_int,
                                 doc_default="4 MiB")
    sse_ping_seconds: float = option(15.0, "interval of SSE comment pings that keep idle streams open through "
                                           "proxies (below their common 60 s idle cut)", positive_float)  # fmt: skip
    shutdown_grace_seconds: float = option(
        20.0, "on SIGTERM or Ctrl-C, how long requests in flight may finish (new ones get 503); the rest then end "
        "with an error event, exit status 0 (below Kubernetes' 30 s before SIGKILL)", non_negative_float)  # fmt: skip
    log_level: str = option("info", "critical, error, warning, info or debug", one_of(LOG_LEVELS, lower=True))
    chat_page: bool = option(True, "do not serve the browser chat page (examples/chat.html) at /",
                             doc_default="served")
    priority_header: str | None = option(None, "read a request's `priority` from this header when its body gives "
                                               "none (for front ends that cannot add fields; an integer, lower "
                                               "is served first)")  # fmt: skip
    queue_timeout_seconds: float | None = option(
        None, "the default `timeout` of a request: one still waiting for admission past it is answered 503 with "
        "Retry-After (an error event if its stream has begun) instead of being served late",
        or_none(positive_float))  # fmt: skip
    stream_grace_seconds: float = option(
        30.0, "a stream whose client disconnected is paused (KV kept) this long for a reconnect to resume it "
        "(GET /v1/chat/completions/ID/stream with Last-Event-ID), then aborted; 0 aborts at once",
        non_negative_float)  # fmt: skip
    stream_resume_bytes: int = option(4 << 20, "events of one stream kept for a reconnect; past it the oldest events "
                                               "already sent are dropped (a reconnect from before them gets 410)",
                                      positive_int, doc_default="4 MiB")  # fmt: skip
    responses_store_seconds: float = option(3600.0, "how long a finished Responses API response created with "
                                                    "`store: true` stays retrievable", positive_float)  # fmt: skip
    chat_template: str | None = option(
        None, "a Jinja chat template file to use instead of the model's (vLLM's option), for a model whose file "
        "lacks one or carries a wrong one; rendered once with a sample conversation at start, so a template that "
        "fails stops the server there")  # fmt: skip
    tool_call_parser: str = option(
        "auto", "the tool-call syntax of the model (vLLM's names): `hermes` (`<tool_call>` JSON, Qwen2.5), "
        "`llama3_json` (Llama 3.1-3.3), `mistral` (`[TOOL_CALLS]`), `qwen3_coder` (`<function=...>` XML), or "
        "`auto`: read from the chat template", one_of(TOOL_CALL_PARSERS))  # fmt: skip
    reasoning_parser: str = option(
        "auto", "how chat answers separate a thinking model's reasoning (`reasoning_content`) from its answer: "
        "`qwen3` (the model opens `<think>` itself), `deepseek_r1` (the template opens it: all up to `</think>` "
        "is reasoning), `auto` (picked from the chat template and vocabulary, logged at start) or `none`",
        one_of(PARSERS))  # fmt: skip
    reasoning_config: str | None = option(
        None, 'other markers for the reasoning parser: `{"reasoning_start_str": ..., "reasoning_end_str": ...}`',
        or_none(reasoning_config))  # fmt: skip
    default_chat_template_kwargs: str | None = option(
        None, "a JSON object of variables every chat request passes to the template (a request's "
        '`chat_template_kwargs` win), e.g. `{"enable_thinking": false}`', or_none(template_kwargs))  # fmt: skip
    default_thinking_budget: int | None = option(
        None, "the most thinking tokens of a chat answer whose request sets no `thinking_token_budget` or "
        "`reasoning_effort`: past it the end of the thinking is forced and the answer follows",
        or_none(non_negative_int), doc_default="no limit")  # fmt: skip
    responses_store_max: int = option(1000, "stored responses kept at most, in memory; the oldest finished ones go "
                                            "first", positive_int)  # fmt: skip

    # the engine's options, read where the server needs them
    @property
    def max_queue(self) -> int:
        return self.engine.max_queue

    @property
    def max_unread_bytes(self) -> int | None:
        return self.engine.max_unread_bytes

    @property
    def slow_reader_timeout_seconds(self) -> float:
        return self.engine.slow_reader_timeout_seconds


@dataclass(frozen=True, slots=True)
class RayOptions:
    """`treadle serve --ray`: replicas behind Ray Serve's HTTP proxy (the `ray` extra; docs/scaling.md)."""

    replicas: int = option(2, "engine replicas", positive_int)
    threads_per_replica: int = option(1, "pool threads of each replica, pinned to its own cores (the replica's "
                                         "--threads)", positive_int)  # fmt: skip
    prefix_affinity: bool = option(True, "route by load alone (power of two choices), not to the replica holding "
                                         "the prompt's prefix", doc_default="affinity on")  # fmt: skip
    ray_address: str | None = option(None, "an existing Ray cluster", doc_default="a cluster started in process")


RAY_SWITCH = ("--ray", "serve through Ray Serve's HTTP proxy on --host/--port, --replicas replicas each taking every "
                       "option above (docs/scaling.md)")  # fmt: skip
# variables not named after their flag
_ENVIRONMENT = {"ray_address": "RAY_ADDRESS"}


def env_var(flag: str) -> str:
    """`--max-num-seqs` reads `TREADLE_MAX_NUM_SEQS`; a switch `--no-chat-page` reads `TREADLE_CHAT_PAGE`."""
    return ENV_PREFIX + flag.removeprefix("--").removeprefix("no-").replace("-", "_").upper()


def _env_of(f: Field[Any], spec: OptionSpec) -> str:
    return _ENVIRONMENT.get(f.name) or env_var(flag_of(f, spec))


def _server_fields() -> list[tuple[Field[Any], OptionSpec]]:
    result: list[tuple[Field[Any], OptionSpec]] = []
    for f in ServerSettings.__dataclass_fields__.values():
        if f.name == "engine":
            result += option_fields(EngineConfig)
        elif "option" in f.metadata:
            result.append((f, f.metadata["option"]))
    return result


def _argparse_type(spec: OptionSpec) -> Any:
    def parse(text: str) -> Any:
        try:
            return spec.parse(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "value"  # argparse names the type in its messages
    return parse


def _add(group: argparse._ActionsContainer, f: Field[Any], spec: OptionSpec) -> None:
    flag, name = flag_of(f, spec), _env_of(f, spec)
    help_ = f"{spec.help} (default: {doc_default(f, spec)}) [{name}]".replace("%", "%%")
    value = os.environ.get(name)
    default = default_of(f)
    if isinstance(default, bool):
        try:
            default = default if value is None else switch(value)
        except ValueError as exc:
            raise SystemExit(f"treadle serve: error: {name} {exc}") from None
        group.add_argument(flag, dest=f.name, action="store_false" if flag.startswith("--no-") else "store_true",
                           default=default, help=help_)
    elif spec.many:
        group.add_argument(flag, dest=f.name, nargs="+", metavar="NAME", type=_argparse_type(spec),
                           default=tuple(value.split()) if value else default, help=help_)
    else:
        # argparse converts a string default with `type`, so a bad environment value fails like a bad flag
        group.add_argument(flag, dest=f.name, type=_argparse_type(spec), default=default if value is None else value,
                           help=help_)


def doc_default(f: Field[Any], spec: OptionSpec) -> str:
    if spec.doc_default is not None:
        return spec.doc_default
    value = default_of(f)
    if value is None or value == ():
        return "none"
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_parser(prog: str = "treadle serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve the OpenAI-compatible API over HTTP.",
                                     epilog="Every option can also be set with the environment variable named "
                                            "in brackets; a flag on the command line wins.")
    for f, spec in _server_fields():
        _add(parser, f, spec)
    ray = parser.add_argument_group("Ray Serve (the `ray` extra)")
    ray.add_argument(RAY_SWITCH[0], action="store_true", help=RAY_SWITCH[1])
    for f, spec in option_fields(RayOptions):
        _add(ray, f, spec)
    return parser


def parse_settings(argv: list[str]) -> ServerSettings:
    return parse_serve_args(argv)[0]


def parse_serve_args(argv: list[str]) -> tuple[ServerSettings, RayOptions | None]:
    """The settings, and the Ray Serve options if `--ray` was given."""
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    ray_values = {f.name: values.pop(f.name) for f, _ in option_fields(RayOptions)}
    ray = RayOptions(**ray_values) if values.pop("ray") else None
    engine_values = {f.name: values.pop(f.name) for f, _ in option_fields(EngineConfig)}
    usable_cores = len(os.sched_getaffinity(0))
    threads = engine_values["n_threads"]
    if threads is not None and threads > usable_cores:
        parser.error(f"--threads {threads} is more than the {usable_cores} usable cores: the pool's threads "
                     "spin, and two sharing a core wait out each other's time slices at every barrier")
    values["served_model_name"] = tuple(values["served_model_name"])
    try:
        return ServerSettings(**values, engine=EngineConfig(**engine_values)), ray
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: error() exits


def options_table() -> str:
    """docs/serving.md's option table, from the declarations."""
    rows = ["| option | environment | default | what |", "| --- | --- | --- | --- |"]
    for cls_fields in (_server_fields(), [(None, None)], option_fields(RayOptions)):
        for f, spec in cls_fields:
            if f is None:
                rows.append(f"| `{RAY_SWITCH[0]}` | | off | {RAY_SWITCH[1]} |")
                continue
            flag, env = f"`{flag_of(f, spec)}`", f"`{_env_of(f, spec)}`"
            if spec.many:
                flag, env = f"`{flag_of(f, spec)} NAME [NAME ...]`", f"{env} (space-separated)"
            if isinstance(default_of(f), bool):
                env = f"`{_env_of(f, spec)}=0`"
            rows.append(f"| {flag} | {env} | {doc_default(f, spec)} | {spec.help} |")
    return "\n".join(rows) + "\n"
