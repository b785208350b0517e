"""The app's pieces without a server process: settings, chunk shapes, token bytes, the disconnect race,
and an app whose engine is not warm yet."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from app.metrics import ServerMetrics
from app.protocol import ChatFormatter, CompletionFormatter, ResponseHeader, TokenText
from app.runs import Event
from app.settings import RayOptions, build_parser, parse_serve_args, parse_settings
from app.streaming import SSE_FRAMING, run_until_disconnect
from decoding.engine.engine import resolve_kv_cache_dtype
from decoding.engine.outputs import RequestOutput, Usage
from decoding.engine.sampling import TokenLogprobs


def test_every_option_reads_its_environment_variable_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("TREADLE_PORT", "9001")
    monkeypatch.setenv("TREADLE_MAX_QUEUE", "7")
    monkeypatch.setenv("TREADLE_CORS_ORIGINS", "http://a.test, http://b.test")
    monkeypatch.setenv("TREADLE_API_KEY", "k")
    settings = parse_settings(["--max-queue", "9"])
    assert settings.port == 9001 and settings.max_queue == 9 and settings.api_key == "k"
    assert settings.cors_origins == ("http://a.test", "http://b.test")
    assert settings.engine.max_queue == 9
    assert settings.engine.speculative == "off"
    monkeypatch.setenv("TREADLE_SPECULATIVE", "auto")
    config = parse_settings(["--speculative-max-tokens", "4"]).engine
    assert (config.speculative, config.speculative_max_tokens) == ("auto", 4)
    monkeypatch.setenv("TREADLE_KV_CACHE_DTYPE", "float32")
    assert resolve_kv_cache_dtype(parse_settings([]).engine) == "float32"
    assert resolve_kv_cache_dtype(parse_settings(["--kv-cache-dtype", "auto"]).engine) == "float16"
    assert resolve_kv_cache_dtype(parse_settings(["--kv-cache-dtype", "auto", "--kernels", "exact"]).engine) \
        == "float32"


def test_served_model_names_come_from_the_flag_or_the_environment(monkeypatch):
    assert parse_settings([]).served_model_name == ()
    assert parse_settings(["--served-model-name", "gpt-4o-mini", "team/llm"]).served_model_name == \
        ("gpt-4o-mini", "team/llm")
    monkeypatch.setenv("TREADLE_SERVED_MODEL_NAME", "a b")
    assert parse_settings([]).served_model_name == ("a", "b")
    assert parse_settings(["--served-model-name", "c"]).served_model_name == ("c",)


def test_generate_chat_prompt_has_one_bos_as_the_servers_chat_route(tiny_gguf):
    """A model that adds BOS and whose template writes it too: the rendered template is encoded without
    adding special tokens again, by `treadle generate --chat` as by /v1/chat/completions."""
    from app.generate import prompt_ids
    from decoding import load_model
    from decoding.model.tokenizer import Tokenizer
    from tests.tinymodel import CHAT_TEMPLATE

    base = load_model(tiny_gguf).tokenizer
    tokenizer = Tokenizer(base.backend, base.bos_token_id, base.eos_token_ids, add_bos_token=True,
                          chat_template="{{ bos_token }}" + CHAT_TEMPLATE)
    bos = tokenizer.bos_token_id
    chat = prompt_ids(tokenizer, "hello", chat=True, system="be brief")
    assert chat[0] == bos and chat.count(bos) == 1
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert chat == tokenizer.encode_chat(messages)  # what the chat route sends to the engine
    plain = prompt_ids(tokenizer, "hello", chat=False, system=None)
    assert plain == [bos, *tokenizer.encode("hello")]  # a plain prompt still gets the model's BOS


def test_serve_help_lists_the_ray_serve_options(capsys):
    from app.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--ray ", "--replicas", "--threads-per-replica", "--no-prefix-affinity", "--ray-address"):
        assert flag in help_text


def test_ray_options_only_with_ray(monkeypatch):
    monkeypatch.setenv("TREADLE_THREADS_PER_REPLICA", "2")
    settings, ray = parse_serve_args(["--ray", "--replicas", "3", "--no-prefix-affinity", "--port", "8001"])
    assert ray == RayOptions(replicas=3, threads_per_replica=2, prefix_affinity=False)
    assert settings.port == 8001
    assert parse_serve_args(["--replicas", "3"])[1] is None


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-queue", "0"], ["--replicas", "0"],
                                  ["--kv-cache-mb", "-1"], ["--log-level", "loud"], ["--kv-cache-dtype", "fp8"],
                                  ["--speculative", "eagle"], ["--speculative-max-tokens", "0"]])
def test_bad_options_exit_with_usage(argv):
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv)
    assert exc.value.code == 2


class FakeTokens:
    def text_of(self, token_id: int) -> str:
        return f"<{token_id}>"

    def bytes_of(self, token_id: int) -> bytes:
        return self.text_of(token_id).encode()


def output(index: int, text: str = "", finish: str | None = None, usage: Usage | None = None,
           logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
    return RequestOutput("r", index, text=text, token_ids=[1] if text else [], finish_reason=finish, usage=usage,
                         logprobs=logprobs or [])


def test_chat_chunks_follow_openais_sequence_per_choice():
    formatter = ChatFormatter(ResponseHeader("chatcmpl-x", "m", 1, "fp_x"), FakeTokens(), n=2, include_usage=False)
    first = formatter.first_chunks()
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in first)
    content = formatter.chunks(output(1, "Hi"))
    assert content == [{"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                        "system_fingerprint": "fp_x",
                        "choices": [{"index": 1, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]}]
    last = formatter.chunks(output(1, "!", "stop", Usage(3, 2)))
    assert [c["choices"][0]["delta"] for c in last] == [{"content": "!"}, {}]
    assert last[-1]["choices"][0]["finish_reason"] == "stop"
    assert formatter.chunks(output(0)) == []  # a delta with no text (held back for a stop string) sends nothing
    assert formatter.last_chunks() == []  # no usage chunk unless asked


def test_usage_chunk_only_when_asked_and_usage_null_before_it():
    formatter = ChatFormatter(ResponseHeader("c", "m", 1), FakeTokens(), n=1, include_usage=True)
    assert formatter.chunks(output(0, "a"))[0]["usage"] is None
    formatter.chunks(output(0, "", "length", Usage(5, 1, cached_tokens=4)))
    [usage_chunk] = formatter.last_chunks()
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                                    "prompt_tokens_details": {"cached_tokens": 4},
                                    "completion_tokens_details": {"reasoning_tokens": 0}}


def test_a_failed_generation_streams_an_error_event():
    formatter = ChatFormatter(ResponseHeader("c", "m", 1), FakeTokens(), n=1, include_usage=False)
    failed = RequestOutput("r", 0, finish_reason="error", error="boom")
    assert formatter.chunks(failed) == [{"error": {"message": "boom", "type": "server_error", "param": None,
                                                   "code": None}}]


@pytest.mark.parametrize("formatter_class", [ChatFormatter, CompletionFormatter])
def test_a_whole_answer_has_usage_whichever_choice_finished_last(formatter_class):
    """Found by the soak: the usage rides on the request's last delta, here choice 0's (n=2)."""
    extra = {"prompt_ids": [1], "echo_text": None} if formatter_class is CompletionFormatter else {}
    formatter = formatter_class(ResponseHeader("c", "m", 1), FakeTokens(), n=2, include_usage=False, **extra)
    response = formatter.response([output(0, "a", "stop", Usage(3, 4)), output(1, "b", "length")])
    assert response["usage"]["completion_tokens"] == 4


def test_sse_events_never_carry_a_raw_unicode_line_separator():
    """httpx's iter_lines (like str.splitlines) cuts lines at NEL, U+2028 and U+2029; JSON escapes keep them."""
    text = "a\x85b\u2028c\u2029d é"
    event = SSE_FRAMING.encode(Event(7, {"text": text}, 0))
    id_line, data = event.split(b"\n", 1)
    assert id_line == b"id: 7" and data.startswith(b"data: ") and data.endswith(b"\n\n")
    line = data.decode().removesuffix("\n\n")
    assert line.splitlines() == [line]
    assert json.loads(data[6:])["text"] == text
    # an event outside the stream's numbering (an error about the stream itself) moves no client's id
    assert SSE_FRAMING.encode(Event(-1, {"error": {}}, 0)).startswith(b"data: ")


def test_completion_echo_prefixes_the_prompt_once_per_choice_with_its_logprobs():
    formatter = CompletionFormatter(ResponseHeader("cmpl-x", "m", 1), FakeTokens(), n=1, include_usage=False,
                                    prompt_ids=[7, 8], echo_text="<7><8>")
    first = output(0, "<9>", logprobs=[TokenLogprobs(9, -0.5, [(9, -0.5)])])
    first.prompt_logprobs = [None, TokenLogprobs(8, -2.0, [(3, -1.0)])]
    [chunk] = formatter.chunks(first)
    choice = chunk["choices"][0]
    assert choice["text"] == "<7><8><9>"
    assert choice["logprobs"] == {"tokens": ["<7>", "<8>", "<9>"], "token_logprobs": [None, -2.0, -0.5],
                                  "top_logprobs": [None, {"<3>": -1.0}, {"<9>": -0.5}], "text_offset": [0, 3, 6]}
    [later] = formatter.chunks(output(0, "<4>", logprobs=[TokenLogprobs(4, -1.0, [])]))
    assert later["choices"][0]["text"] == "<4>" and later["choices"][0]["logprobs"]["text_offset"] == [9]


def test_token_bytes_keep_half_a_character(default_model):
    tokens = TokenText(default_model.tokenizer)
    ids = default_model.tokenizer.encode("🦙")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    assert b"".join(tokens.bytes_of(i) for i in ids) == "🦙".encode()
    assert tokens.text_of(default_model.tokenizer.encode(" Paris")[0]) == " Paris"


def test_each_app_has_its_own_metrics_registry():
    first, second = ServerMetrics(), ServerMetrics()  # a shared registry would refuse the second
    first.requests_rejected.inc()
    assert b"treadle_requests_rejected_total 1.0" in first.render()
    assert b"treadle_requests_rejected_total 0.0" in second.render()


def test_run_until_disconnect_cancels_the_work_when_the_client_leaves():
    async def scenario() -> tuple[bool, bool, bool]:
        client_left = asyncio.Event()
        work_cancelled = asyncio.Event()

        async def receive_after_leaving() -> dict:
            await client_left.wait()
            return {"type": "http.disconnect"}

        async def receive_never() -> dict:
            await asyncio.Event().wait()
            return {}

        async def endless_work() -> None:
            client_left.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                work_cancelled.set()
                raise

        async def quick_work() -> None:
            await asyncio.sleep(0)

        left = await run_until_disconnect(receive_after_leaving, endless_work)
        completed = await run_until_disconnect(receive_never, quick_work)
        return left, work_cancelled.is_set(), completed

    assert asyncio.run(scenario()) == (False, True, True)


def test_before_warm_up_health_and_generation_answer_503(default_model):
    from app.application import build_app
    from app.settings import ServerSettings
    from decoding.engine.engine import Engine, EngineConfig

    engine = Engine(default_model, EngineConfig(num_kv_blocks=8, n_threads=1, pin_threads=False))
    try:
        app = build_app(ServerSettings(), engine)  # ASGITransport runs no lifespan: the warm-up never starts

        async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return (await client.get("/health"),
                        await client.post("/v1/completions", json={"prompt": "hi"}),
                        await client.post("/tokenize", json={"prompt": "hi"}))

        health, completion, tokenized = asyncio.run(scenario())
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert completion.status_code == 503 and completion.headers["retry-after"] == "1"
        assert completion.json()["error"]["code"] == "not_ready"
        assert tokenized.status_code == 200  # the tokenizer needs no warm engine
    finally:
        engine.shutdown()


def test_warm_up_freezes_what_lives_as_long_as_the_process(default_model):
    import gc

    from app.server import ServingState
    from app.settings import ServerSettings
    from decoding.engine.engine import Engine, EngineConfig

    engine = Engine(default_model, EngineConfig(num_kv_blocks=8, n_threads=1, pin_threads=False))
    try:
        state = ServingState(ServerSettings(), engine, None)
        gc.unfreeze()
        state.warm_up()
        assert state.is_ready and state.startup_error is None
        assert gc.get_freeze_count() > 0  # the model, tokenizer and app are out of later full collections
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
        engine.shutdown()


def test_more_threads_than_usable_cores_is_a_clear_command_line_error(capsys):
    cores = len(os.sched_getaffinity(0))
    assert parse_settings(["--threads", str(cores)]).engine.n_threads == cores
    with pytest.raises(SystemExit):
        parse_settings(["--threads", str(cores + 1)])
    assert "usable cores" in capsys.readouterr().err


def test_the_treadle_command_points_numba_at_the_cache_named_after_every_kernel_source(tmp_path):
    """Without it numba keeps a caller's cached copy of a kernel edited in another file (numba checks
    only the caller's own file): after a `git pull`, `treadle serve` ran stale kernels and streamed noise."""
    import subprocess
    import sys

    from threadpool.numba_cache import REPO, kernel_sources_hash

    code = "import os, app.cli; app.cli.main(['--help']); print(os.environ['NUMBA_CACHE_DIR'])"
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == str(REPO / ".numba_cache" / kernel_sources_hash())


@pytest.mark.parametrize("configured", [None, "base", "hashed"])
def test_any_script_that_loads_the_kernels_uses_the_cache_named_after_their_sources(tmp_path, configured):
    """A script run without the Makefile's NUMBA_CACHE_DIR (or with a directory of its own) once loaded
    kernels cached before an edit to a file they inline, and decoded Qwen2.5 as '!!!!': importing
    decoding or threadpool now names the directory after the sources, numba loaded first or not."""
    import os
    import subprocess
    import sys

    from threadpool.numba_cache import REPO, kernel_sources_hash

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    base = tmp_path / "numba"
    if configured == "base":
        env["NUMBA_CACHE_DIR"] = str(base)
    elif configured == "hashed":
        env["NUMBA_CACHE_DIR"] = str(base / kernel_sources_hash())
    code = "import numba, decoding.kernels.forward; print(numba.config.CACHE_DIR)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          check=True)  # fmt: skip
    expected = (REPO / ".numba_cache" if configured is None else base) / kernel_sources_hash()
    assert done.stdout.strip().splitlines()[-1] == str(expected)


def test_every_serve_option_is_in_the_docs_table_with_its_environment_variable():
    """docs/serving.md's option table is what users read: it is written from the options' declarations, so
    it must be current, and every flag the parser has must have its row with the variable it reads."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from app.settings import options_table

    root = Path(__file__).parent.parent
    check = subprocess.run([sys.executable, "scripts/options_table.py", "--check"], cwd=root, capture_output=True)
    assert check.returncode == 0, check.stderr.decode()
    parser = build_parser()
    flags = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    rows = [line.split(" | ") for line in options_table().splitlines() if line.startswith("| `--")]
    documented = {flag: row for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row[0])}
    assert sorted(set(flags) - set(documented)) == [], "flags without a row"
    assert sorted(set(documented) - set(flags)) == [], "rows for flags the parser does not have"
    for flag, action in flags.items():
        variable = re.search(r"\[([A-Z_]+)\]$", action.help or "")
        if variable:  # the option reads this variable: the row names it
            assert variable.group(1) in documented[flag][1], (flag, variable.group(1))


def test_every_engine_option_is_reachable_from_the_command_line_and_checked_in_code_alike():
    from dataclasses import fields

    from decoding.engine.config import EngineConfig

    parser_dests = {a.dest for a in build_parser()._actions}
    assert {f.name for f in fields(EngineConfig)} <= parser_dests
    assert parse_settings(["--max-itl-stretch", "3", "--max-model-len", "512", "--no-pin-threads"]).engine == \
        EngineConfig(max_itl_stretch=3.0, max_model_len=512, pin_threads=False)
    with pytest.raises(ValueError, match="speculative: must be one of off, auto, ngram"):
        EngineConfig(speculative="sometimes")
    with pytest.raises(ValueError, match="max_itl_stretch: must be more than 1"):
        EngineConfig(max_itl_stretch=0.5)
    with pytest.raises(SystemExit):
        parse_settings(["--max-itl-stretch", "0.5"])


def test_the_system_fingerprint_names_the_cpu_the_kernels_were_compiled_for(monkeypatch):
    """Float rounding follows the compile target, so seeded outputs repeat only where the fingerprint
    does: it changes with the CPU, the kernels and the KV type, not with anything else."""
    from types import SimpleNamespace

    from app import server
    from decoding.engine.config import EngineConfig

    def fingerprint(**config: object) -> str:
        return server.system_fingerprint(SimpleNamespace(model=SimpleNamespace(name="m"),
                                                         config=EngineConfig(**config)))  # type: ignore[arg-type]

    here = fingerprint()
    assert here == fingerprint() and here.startswith("fp_treadle_")
    assert fingerprint(kernels="exact") != here and fingerprint(kv_cache_dtype="int8") != here
    monkeypatch.setattr(server.binding, "get_host_cpu_name", lambda: "not-this-cpu")
    assert fingerprint() != here
