"""examples/ run as a user would run them, against a real `treadle serve` (the shared "main" server:
exact kernels, so greedy text is reproducible and each example's output can be compared with a
non-streamed answer to the same request), and the chat page route."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from bench.sse import iter_sse_data
from tests.conftest_server import REPO, shared_server

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
SYSTEM = "You are a concise, helpful assistant."
QUESTION = "Count from one to twenty in words, separated by commas."


@pytest.fixture(scope="module")
def server():
    return shared_server("main")


def reference_reply(base_url: str, max_tokens: int) -> str:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def run_streaming(args: list[str], env: dict[str, str] | None = None) -> tuple[str, str, int]:
    """Run an example; return (stdout, stderr, how many separate reads stdout arrived in)."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                               env={**os.environ, **(env or {})})
    assert process.stdout is not None and process.stderr is not None
    pieces = []
    while chunk := os.read(process.stdout.fileno(), 65536):
        pieces.append(chunk)
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    return b"".join(pieces).decode(), stderr, len(pieces)


@pytest.mark.parametrize("script", ["openai_stream.py", "msgpack_stream.py"])
def test_python_example_streams_the_same_text_as_a_plain_request(server, script):
    max_tokens = 48
    stdout, stderr, num_reads = run_streaming(
        [sys.executable, str(EXAMPLES / script), "--base-url", server.base_url, "--system", SYSTEM,
         "--max-tokens", str(max_tokens), "--temperature", "0", QUESTION])
    assert stdout.rstrip("\n") == reference_reply(server.base_url, max_tokens)
    assert num_reads >= 2, "the example printed its reply in one piece, not as tokens arrived"
    assert "completion tokens]" in stderr and "prompt +" in stderr  # usage from the final chunk


def test_python_example_defaults_to_the_local_server_url():
    for script in ("openai_stream.py", "msgpack_stream.py"):
        out = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], capture_output=True, text=True,
                             check=True).stdout
        assert "--base-url" in out and "http://127.0.0.1:8000" in out


def sse_events(text: str) -> list[str]:
    return list(iter_sse_data([text.encode()]))


@pytest.mark.parametrize("how", ["flag", "env"])
def test_curl_example_streams_chat_and_completions(server, how):
    if how == "flag":
        args, env = ["bash", str(EXAMPLES / "curl.sh"), "--base-url", server.base_url, 'Say "hi" \\ twice'], {}
    else:
        args, env = ["bash", str(EXAMPLES / "curl.sh"), "Say hi."], {"BASE_URL": server.base_url}
    stdout, _, _ = run_streaming(args, {**env, "MAX_TOKENS": "12"})
    chat_part, completion_part = stdout.split("# completions: POST ")
    assert chat_part.startswith(f"# chat: POST {server.base_url}/v1/chat/completions")

    chat = sse_events(chat_part)
    assert chat[-1] == "[DONE]"
    chunks = [json.loads(e) for e in chat[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    chat_finish = [c["choices"][0]["finish_reason"] for c in chunks
                   if c["choices"] and c["choices"][0]["finish_reason"]]
    assert chat_finish in (["length"], ["stop"]) and (content or chat_finish == ["stop"])  # sampled, as below
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= 12  # include_usage
    if how == "flag":  # the quote and backslash in the question reached the server as JSON, intact
        assert chunks[-1]["usage"]["prompt_tokens"] > 20

    completion = sse_events(completion_part)
    assert completion[-1] == "[DONE]"
    pieces = [json.loads(e) for e in completion[:-1]]
    assert all(p["object"] == "text_completion" for p in pieces)
    text = "".join(p["choices"][0]["text"] for p in pieces if p["choices"])
    finish = [p["choices"][0]["finish_reason"] for p in pieces if p["choices"] and p["choices"][0]["finish_reason"]]
    # sampled (the example sets no temperature): an end of text may come first, and twelve tokens may be
    # whitespace only, but a stream that ran to max_tokens carried text
    assert finish in (["length"], ["stop"]) and (text or finish == ["stop"])


def test_curl_example_fails_loudly_when_no_server_listens():
    result = subprocess.run(["bash", str(EXAMPLES / "curl.sh"), "--base-url", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "curl:" in result.stderr


def test_chat_page_is_served_at_root_unless_turned_off(default_model):
    from app.application import build_app
    from app.settings import ServerSettings
    from decoding.engine.engine import Engine, EngineConfig

    engine = Engine(default_model, EngineConfig(num_kv_blocks=8, n_threads=1, pin_threads=False))
    try:
        async def get_root(settings: ServerSettings) -> httpx.Response:
            app = build_app(settings, engine)  # ASGITransport runs no lifespan: no warm-up needed for /
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.get("/")

        page = asyncio.run(get_root(ServerSettings()))
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.text == (EXAMPLES / "chat.html").read_text()
        off = asyncio.run(get_root(ServerSettings(chat_page=False)))
        assert off.status_code == 404 and "error" in off.json()
    finally:
        engine.shutdown()


def test_chat_page_option_reads_flag_and_environment(monkeypatch):
    from app.settings import parse_settings

    monkeypatch.delenv("TREADLE_CHAT_PAGE", raising=False)
    assert parse_settings([]).chat_page is True
    assert parse_settings(["--no-chat-page"]).chat_page is False
    monkeypatch.setenv("TREADLE_CHAT_PAGE", "0")
    assert parse_settings([]).chat_page is False
    monkeypatch.setenv("TREADLE_CHAT_PAGE", "on")
    assert parse_settings([]).chat_page is True
    monkeypatch.setenv("TREADLE_CHAT_PAGE", "maybe")
    with pytest.raises(SystemExit):
        parse_settings([])


def test_chat_page_is_plain_html_with_no_build_step():
    page = (EXAMPLES / "chat.html").read_text()
    assert "<script src" not in page and "import " not in page.split("<script>")[1]  # nothing to fetch or bundle
    for feature in ("AbortController", "getReader", "TextDecoderStream", "/v1/chat/completions", "429"):
        assert feature in page, feature
