"""`treadle bench soak`: its stream checker on hand-made streams, a short soak that passes against a real
server (streams, disconnects, malformed bodies, a cache small enough to preempt), and one that fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.faults import EVERY_N_STEPS
from bench.soak import percentile
from bench.soak_checks import check_sse_events, check_whole_response

from .conftest_server import REPO, TreadleServer, server_env
from .reliability import running_server, write_tiny_gguf
from .tinymodel import CHAT_TEMPLATE


def chunk(index: int = 0, content: str | None = "a", finish: str | None = None, role: bool = False,
          **extra: object) -> str:
    delta = {"role": "assistant", "content": ""} if role else ({} if finish else {"content": content})
    return json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": index, "delta": delta, "finish_reason": finish}], **extra})


GOOD = [chunk(role=True), chunk(content="Hi"), chunk(finish="stop"), "[DONE]"]


def test_a_well_formed_chat_stream_has_no_problems():
    assert check_sse_events(GOOD, "chat", 1, include_usage=False) == []
    usage = json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 1}})
    with_usage = [chunk(role=True, usage=None), chunk(content="Hi", usage=None), chunk(finish="length", usage=None),
                  usage, "[DONE]"]
    assert check_sse_events(with_usage, "chat", 1, include_usage=True) == []


@pytest.mark.parametrize(("events", "problem"), [
    (GOOD[:-1], "does not end with [DONE]"),
    ([GOOD[0], GOOD[1], "[DONE]"], "no finish_reason"),
    ([*GOOD[:3], chunk(content="late"), "[DONE]"], "continues after its finish_reason"),
    ([GOOD[0], json.dumps({"error": {"message": "boom"}}), "[DONE]"], "error event: boom"),
    ([chunk(content="Hi"), *GOOD[2:]], "starts without role"),
    ([GOOD[0], chunk(finish="abort"), "[DONE]"], "finish_reason 'abort'"),
    ([GOOD[0], GOOD[1], "[DONE]", GOOD[2], "[DONE]"], "[DONE] before the end"),
    ([GOOD[0], "{not json", *GOOD[2:]], "not JSON"),
])
def test_ill_formed_streams_are_reported(events, problem):
    problems = check_sse_events(events, "chat", 1, include_usage=False)
    assert any(problem in p for p in problems), problems


def test_usage_must_come_only_when_asked_and_choices_must_all_finish():
    assert any("usage" in p for p in check_sse_events(GOOD, "chat", 1, include_usage=True))
    assert any("choices [1]" in p for p in check_sse_events(GOOD, "chat", 2, include_usage=False))


def test_whole_responses_are_checked_too():
    body = {"object": "text_completion", "choices": [{"index": 0, "finish_reason": "length"}], "usage": {}}
    assert check_whole_response(body, "completion", 1) == []
    assert check_whole_response({**body, "choices": []}, "completion", 1)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def soak(server: TreadleServer, tmp_path: Path, *args: str) -> tuple[int, dict[str, object]]:
    report = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, "-m", "app.cli", "bench", "soak", "--base-url", server.base_url,
                             "--json", str(report), *args], cwd=REPO, env=server_env(), capture_output=True,
                            text=True, timeout=600, check=False)
    print(result.stdout, result.stderr)
    return result.returncode, json.loads(report.read_text())


@pytest.mark.slow
def test_a_short_soak_passes_every_check(tmp_path):
    # 24 MiB of KV (34 blocks, 544 tokens) for 8 clients of up to ~150 prompt tokens + 64: some are preempted.
    # a disconnected stream is paused 3 s for a reconnect, not the default 30: the soak's at-rest check and
    # the drain on SIGTERM would wait for it
    with running_server(["--kv-cache-mb", "24", "--max-num-seqs", "8", "--stream-grace-seconds", "3"]) as server:
        status, report = soak(server, tmp_path, "--duration", "15", "--clients", "8", "--disconnect-rate", "0.3",
                              "--malformed-rate", "0.2", "--max-prompt-words", "100", "--max-tokens", "64",
                              "--max-health-p99-ms", "60000")  # liveness, not speed: this machine is shared
    results = report["results"]
    failed = [check for check in report["checks"] if not check["ok"]]
    assert status == 0 and not failed, failed
    assert results["streams_completed"] > 0 and results["disconnects"] > 0 and results["malformed_sent"] > 0
    assert results["kv_blocks_used_at_rest"] == 0 and results["server_errors_5xx"] == 0


@pytest.mark.slow
def test_a_soak_against_a_failing_engine_fails(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", CHAT_TEMPLATE)
    with running_server(["--model", str(model), "--stream-grace-seconds", "3"], env={EVERY_N_STEPS: "5"}) as server:
        status, report = soak(server, tmp_path, "--duration", "3", "--clients", "4", "--max-prompt-words", "10",
                              "--max-tokens", "16")
    failed = {check["name"] for check in report["checks"] if not check["ok"]}
    assert status == 1 and "no error events" in failed
    assert report["results"]["error_events"] > 0
