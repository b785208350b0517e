"""An exception inside an engine step (injected by the test-only hook in app/faults.py) ends only the
requests of that step, each with an error event; the server goes on serving the rest and new ones."""

from __future__ import annotations

import json

import httpx
import pytest

from app.faults import EVERY_N_STEPS, FATAL_SEED, SEED, InjectedFault, StepFaults, install_from_env
from bench.soak_checks import check_sse_events
from decoding.engine.step import ScheduledStep

from .reliability import StreamReader, running_server

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FAULT_SEED = 4242
FAILED = 'treadle_request_success_total{finish_reason="error"}'


def chat(content: str, **fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "ignore_eos": True, **fields}


@pytest.mark.slow
def test_a_failing_step_ends_only_its_request_and_the_server_serves_on():
    # One sequence at a time, so each step holds one request: the faulty one fails alone.
    with running_server(["--max-num-seqs", "1"],
                        env={SEED: str(FAULT_SEED)}) as server:
        assert "TEST FAULT INJECTION IS ON" in server.log()
        before = server.metrics()
        running = StreamReader(server.base_url, CHAT, chat("Tell me about looms.")).wait_events(2)
        faulty = StreamReader(server.base_url, CHAT, chat("Tell me about wheels.", temperature=0.7, seed=FAULT_SEED))
        queued = StreamReader(server.base_url, COMPLETIONS, {"prompt": "The mill", "max_tokens": 8})

        assert check_sse_events(running.finish(), "chat", 1, include_usage=False) == []
        events = faulty.finish()
        assert events[-1] == "[DONE]" and len(events) == 3  # the role chunk, the error, [DONE]
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "InjectedFault" in error["message"]
        assert check_sse_events(queued.finish(), "completion", 1, include_usage=False) == []

        # Not streamed: the failure is the whole answer, a 500 with an OpenAI error body.
        whole = httpx.post(f"{server.base_url}{CHAT}", json=chat("Hi", seed=FAULT_SEED), timeout=120)
        assert whole.status_code == 500 and "InjectedFault" in whole.json()["error"]["message"]

        after = httpx.post(f"{server.base_url}{CHAT}", json=chat("And now?"), timeout=120)
        assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
        server.wait_for_metrics(lambda m: m[FAILED] - before.get(FAILED, 0) == 2 and m["treadle_kv_blocks_used"] == 0
                                and m["treadle_requests_running"] == 0 and m["treadle_requests_waiting"] == 0)
        assert "Traceback" in server.log() and "InjectedFault" in server.log()  # logged for the operator


PASSAGE = ("The weaver sat at the loom before dawn, counting threads by the light of a small lamp. "
           "Each row of the cloth took her a minute, and each minute the pattern grew a little longer.")


def greedy_completion(server_url: str, **fields: object) -> StreamReader:
    return StreamReader(server_url, COMPLETIONS, {"prompt": PASSAGE, "max_tokens": 24, "temperature": 0,
                                                   "ignore_eos": True, **fields})


@pytest.mark.slow
def test_the_retry_after_a_failed_step_streams_what_a_fresh_server_streams():
    # The failed step had reserved and hashed the prompt's blocks but never wrote them: had they been
    # published, the retry (the openai package retries a 500 by itself) would attend over garbage.
    with running_server(["--max-num-seqs", "2"], env={SEED: str(FAULT_SEED)}) as server:
        failed = greedy_completion(server.base_url, seed=FAULT_SEED).finish()
        assert "InjectedFault" in json.loads(failed[-2])["error"]["message"]
        retried = greedy_completion(server.base_url)
        assert check_sse_events(retried.finish(), "completion", 1, include_usage=False) == []
        server.wait_for_metrics(lambda m: m["treadle_kv_blocks_used"] == 0)
    with running_server(["--max-num-seqs", "2"]) as fresh:
        expected = greedy_completion(fresh.base_url)
        expected.finish()
    assert retried.text() == expected.text() and len(expected.text()) > 20


@pytest.mark.slow
def test_when_the_engine_thread_dies_health_says_failed_and_nothing_hangs():
    with running_server(["--max-num-seqs", "4"], env={FATAL_SEED: str(FAULT_SEED)}) as server:
        assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
        bystander = StreamReader(server.base_url, CHAT, chat("Tell me about looms.", max_tokens=2000)).wait_events(2)
        fatal = StreamReader(server.base_url, CHAT, chat("Hi", temperature=0.7, seed=FAULT_SEED))
        for stream in (bystander, fatal):  # every open stream ends, with an error event and [DONE]
            events = stream.finish(timeout=60)
            assert events[-1] == "[DONE]" and "InjectedFatalFault" in json.loads(events[-2])["error"]["message"]
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        refused = httpx.post(f"{server.base_url}{CHAT}", json=chat("Anyone there?"), timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        assert "the engine thread died" in server.log()


# ---- the hook itself, without a server -----------------------------------------------------------


class _Params:
    def __init__(self, seed: int | None) -> None:
        self.seed = seed


class _Seq:
    def __init__(self, seed: int | None) -> None:
        self.params = _Params(seed)


class _Chunk:
    def __init__(self, seed: int | None) -> None:
        self.seq = _Seq(seed)


def step_with(*seeds: int | None) -> ScheduledStep:
    return ScheduledStep(chunks=[_Chunk(s) for s in seeds])  # type: ignore[misc]


def test_every_n_steps_fails_exactly_every_nth_step():
    faults = StepFaults(every_n_steps=3, seed=None)
    outcomes = []
    for _ in range(9):
        try:
            faults(step_with(None))
            outcomes.append("ok")
        except InjectedFault:
            outcomes.append("fault")
    assert outcomes == ["ok", "ok", "fault"] * 3 and faults.num_faults == 3


def test_seed_fault_hits_only_steps_holding_that_seed():
    faults = StepFaults(every_n_steps=None, seed=7)
    faults(step_with(1, None, 8))
    with pytest.raises(InjectedFault):
        faults(step_with(1, 7))


def test_the_hook_is_off_unless_asked_for_and_bad_values_are_refused():
    class _Engine:
        fault_hook = None

    engine = _Engine()
    assert install_from_env(engine, {}) is None and engine.fault_hook is None  # type: ignore[arg-type]
    installed = install_from_env(engine, {EVERY_N_STEPS: "5"})  # type: ignore[arg-type]
    assert installed is not None and engine.fault_hook is installed and installed.every_n_steps == 5
    with pytest.raises(ValueError):
        install_from_env(_Engine(), {EVERY_N_STEPS: "0"})  # type: ignore[arg-type]
