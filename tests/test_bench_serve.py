"""`treadle bench serve`: the statistics and knee rule directly; the load generator against a scripted
OpenAI-like server (no usage, role chunks, 429s, stream errors, early stops) and against real treadle."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench import serve as bench_serve
from bench.serve import BenchConfig, run_bench, synthetic_prompt
from bench.serve_report import format_table
from bench.serve_request import RequestResult, RequestSpec, chunk_text
from bench.serve_stats import Distribution, LevelStats, find_knee
from bench.servers import free_port
from tests.conftest_server import shared_server

# ----------------------------------------------------------------------------------------------
# Pieces
# ----------------------------------------------------------------------------------------------


def test_chunk_text_reads_chat_and_completion_chunks():
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {}, "finish_reason": "length"}]}) == ""
    assert chunk_text({"choices": [{"text": " there"}]}) == " there"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_distribution_is_in_milliseconds_with_interpolated_percentiles():
    seconds = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    dist = Distribution.of(seconds)
    assert dist.mean == pytest.approx(50.5)
    assert dist.p50 == pytest.approx(50.5) and dist.p99 == pytest.approx(float(np.percentile(range(1, 101), 99)))
    assert Distribution.of([]) == Distribution()


def test_tpot_excludes_the_first_token_and_needs_two():
    assert RequestResult(ok=True, ttft=0.2, latency=1.2, output_tokens=11).tpot == pytest.approx(0.1)
    assert RequestResult(ok=True, ttft=0.2, latency=0.2, output_tokens=1).tpot is None
    assert RequestResult(ok=False, ttft=0.2, latency=1.0, output_tokens=5).tpot is None


def level(concurrency: int, p99_ttft_ms: float, tokens_per_s: float) -> LevelStats:
    dist = Distribution(mean=p99_ttft_ms / 2, p50=p99_ttft_ms / 2, p95=p99_ttft_ms, p99=p99_ttft_ms)
    return LevelStats(concurrency=concurrency, num_requests=8, num_completed=8, num_short=0, duration_s=1.0,
                      request_throughput=1.0, output_throughput=tokens_per_s, total_output_tokens=int(tokens_per_s),
                      mean_prompt_tokens=None, usage_source="server", errors={}, ttft_ms=dist, itl_ms=dist,
                      tpot_ms=dist, e2e_ms=dist)


def test_no_knee_while_throughput_keeps_pace_with_latency():
    # Batching: throughput ×3.5 per step while P99 only doubles.
    levels = [level(1, 100, 100), level(4, 200, 350), level(16, 400, 1200)]
    knee = find_knee(levels)
    assert knee.concurrency is None and knee.next_concurrency is None


def test_knee_is_the_last_level_before_p99_outruns_throughput():
    # Saturated past 16: throughput flat, P99 ×4 (queueing) → knee at 16.
    levels = [level(32, 1600, 1250), level(1, 100, 100), level(4, 150, 380), level(16, 400, 1200)]
    knee = find_knee(levels)
    assert (knee.concurrency, knee.next_concurrency) == (16, 32)
    assert knee.factor == pytest.approx((1600 / 400) / (1250 / 1200))
    assert find_knee(levels, threshold=5.0).concurrency is None


def test_levels_without_results_are_ignored_by_the_knee():
    empty = level(8, 0, 0)
    empty.ttft_ms = Distribution()
    assert find_knee([level(1, 100, 100), empty, level(16, 110, 1500)]).concurrency is None


def test_synthetic_prompts_have_the_asked_length_and_distinct_openings():
    import random

    rng = random.Random(0)
    prompts = [synthetic_prompt(128, rng, i) for i in range(20)]
    assert len({p.split(":")[0] for p in prompts}) == 20
    assert all(120 <= len(p.split()) <= 130 for p in prompts)


def test_requests_per_level_default_and_floor():
    config = BenchConfig(base_url="x", model=None, chat=False, concurrency=[1, 32], requests=None, max_tokens=8,
                         prompt_tokens=8, temperature=0, ignore_eos=True, warmup=0, seed=0, timeout_s=10,
                         knee_metric="ttft", knee_factor=1.5)
    assert [config.num_requests(c) for c in (1, 4, 32)] == [8, 8, 64]
    config.requests = 3
    assert [config.num_requests(c) for c in (1, 4)] == [3, 4]  # never fewer requests than clients


def test_request_body_asks_for_usage_full_length_and_takes_extra_fields():
    spec = RequestSpec("http://h/", "m", chat=False, max_tokens=5, temperature=0.0, ignore_eos=True,
                       extra_body={"top_k": 1, "temperature": 0.5})
    assert spec.url == "http://h/v1/completions"
    assert spec.body("p") == {"model": "m", "prompt": "p", "max_tokens": 5, "temperature": 0.5, "stream": True,
                              "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": 5,
                              "top_k": 1}
    strict = RequestSpec("http://h", None, chat=True, max_tokens=5, temperature=0.0, ignore_eos=False)
    body = strict.body("q")
    assert strict.url == "http://h/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "q"}]
    assert "ignore_eos" not in body and "min_tokens" not in body and "model" not in body
    parser = bench_serve.build_parser()
    assert parser.parse_args(["--extra-body", '{"a": 1}']).extra_body == {"a": 1}
    with pytest.raises(SystemExit):
        parser.parse_args(["--extra-body", "[1]"])


def test_bad_concurrency_lists_are_refused():
    parser = bench_serve.build_parser()
    for bad in ("0,4", "a,b", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--concurrency", bad])
    assert parser.parse_args(["--concurrency", "16,1,4,4"]).concurrency == [1, 4, 16]


# ----------------------------------------------------------------------------------------------
# A scripted OpenAI-like server: no usage (as llama-cpp-python), a role chunk first, per-token
# chunks, and failures on request: 429 for prompts containing "Request 3:", a stream error for
# "Request 5:", an early stop for "Request 6:".
# ----------------------------------------------------------------------------------------------

FIRST_TOKEN_DELAY_S = 0.05


def fake_app(bodies: list[dict]) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(request: Request) -> Response:
        body = await request.json()
        bodies.append(body)
        prompt = body["messages"][-1]["content"]
        if prompt.startswith("Request 3:"):
            return JSONResponse({"error": {"message": "full"}}, status_code=429)
        num_tokens = 2 if prompt.startswith("Request 6:") else body["max_tokens"]

        async def events() -> AsyncIterator[str]:
            yield ": ping\n\n"
            yield "data: " + json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)  # the role chunk must not count as the first token
            for i in range(num_tokens):
                if prompt.startswith("Request 5:") and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "boom"}}) + "\n\n"
                    return
                yield "data: " + json.dumps({"choices": [{"delta": {"content": f" t{i}"}}]}) + "\n\n"
                await asyncio.sleep(0.002)
            yield "data: " + json.dumps({"choices": [{"delta": {}, "finish_reason": "length"}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, list[dict]]]:
    bodies: list[dict] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(bodies), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_against_a_server_without_usage_errors_are_counted_by_status(fake_server):
    base_url, bodies = fake_server
    bodies.clear()
    config = BenchConfig(base_url=base_url, model=None, chat=True, concurrency=[1, 4], requests=4, max_tokens=6,
                         prompt_tokens=16, temperature=0.0, ignore_eos=True, warmup=1, seed=0, timeout_s=30,
                         knee_metric="ttft", knee_factor=1.5, progress=False)
    report = asyncio.run(run_bench(config))
    # Requests are numbered across the run: 0 is the warm-up, 1-4 level 1, 5-8 level 4.
    first, second = report["levels"]
    assert first["errors"] == {"429": 1} and first["num_completed"] == 3
    assert second["errors"] == {"stream_error": 1} and second["num_completed"] == 3
    assert second["num_short"] == 1  # request 6 stopped after 2 tokens
    assert first["usage_source"] == "chunks" and first["total_output_tokens"] == 3 * 6
    assert second["total_output_tokens"] == 2 * 6 + 2
    assert first["ttft_ms"]["p50"] >= FIRST_TOKEN_DELAY_S * 1e3  # the role chunk did not count
    assert report["model"] == "fake-model"
    body = bodies[0]
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 6 and body["max_tokens"] == 6
    assert len(bodies) == 1 + 4 + 4
    table = format_table(report)
    assert "429×1" in table and "stream_error×1" in table
    assert "no usage from the server" in table and "ended before max_tokens (1 at concurrency 4)" in table


def test_concurrency_is_the_number_in_flight(fake_server, monkeypatch):
    base_url, _ = fake_server
    in_flight = peak = 0
    original = bench_serve.send_request

    async def counting(client, spec, prompt):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await original(client, spec, prompt)
        finally:
            in_flight -= 1

    monkeypatch.setattr(bench_serve, "send_request", counting)
    config = BenchConfig(base_url=base_url, model="m", chat=True, concurrency=[3], requests=7, max_tokens=3,
                         prompt_tokens=8, temperature=0.0, ignore_eos=False, warmup=0, seed=1, timeout_s=30,
                         knee_metric="ttft", knee_factor=1.5, progress=False)
    report = asyncio.run(run_bench(config))
    assert peak == 3
    assert report["levels"][0]["num_requests"] == 7


def test_cli_fails_cleanly_when_nothing_listens(capsys):
    code = bench_serve.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--concurrency", "1", "--requests", "1",
                             "--warmup", "1", "--no-progress"])
    assert code == 1
    assert "every warm-up request failed" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Against a real treadle serve
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_serve_against_treadle_writes_json_and_plot(tmp_path, capsys):
    server = shared_server("main")
    before = server.metrics()
    json_path, plot_path = tmp_path / "serve.json", tmp_path / "serve.png"
    code = bench_serve.main(["--base-url", server.base_url, "--concurrency", "1,3", "--requests", "3",
                             "--max-tokens", "8", "--prompt-tokens", "32", "--warmup", "1",
                             "--json", str(json_path), "--plot", str(plot_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(json_path.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        assert lv["num_completed"] == 3 and lv["errors"] == {} and lv["num_short"] == 0
        assert lv["usage_source"] == "server" and lv["total_output_tokens"] == 3 * 8  # ignore_eos honoured
        assert 25 <= lv["mean_prompt_tokens"] <= 40
        assert lv["ttft_ms"]["p50"] > 0 and lv["itl_ms"]["p99"] >= lv["itl_ms"]["p50"] > 0
        assert lv["output_throughput"] > 0 and lv["tpot_ms"]["p50"] > 0
    # The server's own count agrees: warm-up + 2 levels × 3 requests × 8 tokens.
    after = server.wait_for_metrics(lambda m: m["treadle_generation_tokens_total"]
                                    - before["treadle_generation_tokens_total"] >= 7 * 8)
    assert after["treadle_generation_tokens_total"] - before["treadle_generation_tokens_total"] == 7 * 8
    assert report["model"] == "smollm2-135m-instruct" and report["endpoint"] == "/v1/completions"
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT p50" in out and "knee:" in out
