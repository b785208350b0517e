"""A run's bookkeeping without a server: readers follow from any kept event, what is kept stays within
its bounds, an abandoned run is aborted after the grace period and a read-to-the-end one is dropped.

The engine side is a real RequestStream fed by the test; the engine itself is a recorder of aborts."""

from __future__ import annotations

import asyncio

import pytest

from app.metrics import ServerMetrics, TokenGapTimer
from app.runs import EventsGone, Generation, Run, RunRegistry
from decoding.engine.outputs import FinishReason, RequestOutput, RequestStream


class AbortRecorder:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class TextFormatter:
    def first_chunks(self) -> list[dict]:
        return [{"start": True}]

    def chunks(self, output: RequestOutput) -> list[dict]:
        return [{"text": output.text}] if output.text else []

    def last_chunks(self) -> list[dict]:
        return [{"end": True}]


def new_run(engine: AbortRecorder, **options) -> tuple[Run, RequestStream]:
    stream = RequestStream("r1", asyncio.get_running_loop())
    settings = {"max_unread_bytes": 1 << 20, "keep_bytes": 1 << 20, "grace_seconds": 0.05, **options}
    generation = Generation(engine, stream, TextFormatter(), TokenGapTimer(ServerMetrics().inter_token_latency))  # type: ignore[arg-type]
    run = Run(generation, **settings)
    return run.start(), stream


async def texts(run: Run, after: int = -1) -> list:
    return [event.chunk.get("text", event.chunk) async for event in run.follow(after)]


async def put_words(stream: RequestStream, words: list[str], last: bool = True) -> None:
    """One output per word, each taken by the pump before the next (else the stream merges them)."""
    for i, word in enumerate(words):
        end = last and i == len(words) - 1
        stream.put(RequestOutput("r1", 0, text=word, finish_reason="stop" if end else None), is_last=end)
        await asyncio.sleep(0.002)


def test_readers_follow_from_any_event_and_a_finished_run_answers_past_its_end_with_an_error():
    async def scenario():
        engine = AbortRecorder()
        run, stream = new_run(engine)
        await put_words(stream, ["a", "b", "c"])
        everything = await texts(run)
        assert everything == [{"start": True}, "a", "b", "c", {"end": True}]
        assert await texts(run, after=2) == ["c", {"end": True}]
        assert await texts(run, after=4) == []
        with pytest.raises(ValueError):
            run.check_kept(5)
        with pytest.raises(ValueError):
            run.check_kept(-2)

    asyncio.run(scenario())


def test_a_reader_ahead_of_the_run_waits_for_the_events_to_come():
    async def scenario():
        run, stream = new_run(AbortRecorder())
        reader = asyncio.ensure_future(texts(run, after=2))
        await asyncio.sleep(0.01)
        await put_words(stream, ["a", "b", "c"])
        assert await reader == ["c", {"end": True}]

    asyncio.run(scenario())


def test_events_already_sent_are_dropped_past_keep_bytes_and_a_resume_before_them_is_refused():
    async def scenario():
        run, stream = new_run(AbortRecorder(), keep_bytes=400)
        reader = asyncio.ensure_future(texts(run))
        await put_words(stream, [f"word{i}" for i in range(40)])
        assert len(await reader) == 42  # the reader got every event
        assert run.num_kept_bytes <= 400 and run.events[0].number > 0
        with pytest.raises(EventsGone):
            run.check_kept(-1)
        run.check_kept(run.events[0].number - 1)  # from the first kept event on is fine

    asyncio.run(scenario())


def test_unsent_output_past_max_unread_bytes_holds_the_pump_and_tells_the_engine():
    async def scenario():
        run, stream = new_run(AbortRecorder(), max_unread_bytes=300)
        await put_words(stream, [f"word{i}" for i in range(40)], last=False)
        await asyncio.sleep(0.05)
        assert run.num_unread_bytes <= 300 + 100  # one output's chunks past the bound at most
        assert stream._reader_blocked_since is not None  # the engine will pause the request
        reader = asyncio.ensure_future(texts(run))
        await put_words(stream, ["end"])
        got = await reader
        # held back, the engine's stream merged the outputs: nothing is lost
        assert "".join(t for t in got if isinstance(t, str)) == "".join(f"word{i}" for i in range(40)) + "end"
        assert stream._reader_blocked_since is None

    asyncio.run(scenario())


def test_an_abandoned_run_is_aborted_after_the_grace_period_unless_a_reader_comes_back():
    async def scenario():
        engine = AbortRecorder()
        registry = RunRegistry()
        run, _ = new_run(engine, grace_seconds=0.1)
        registry.add(run)
        run.attach()
        run.detach()
        await asyncio.sleep(0.05)
        run.attach()  # reconnected within the grace period
        await asyncio.sleep(0.1)
        assert engine.aborted == [] and registry.get("r1") is run
        run.detach()
        await asyncio.sleep(0.15)
        assert engine.aborted == ["r1"] and registry.get("r1") is None

    asyncio.run(scenario())


def test_a_run_read_to_its_end_leaves_the_registry_at_once_and_a_background_run_is_never_abandoned():
    async def scenario():
        engine = AbortRecorder()
        registry = RunRegistry()
        run, stream = new_run(engine, grace_seconds=30)
        registry.add(run)
        await put_words(stream, ["a"])
        run.attach()
        await texts(run)
        run.detach(read_to_the_end=True)
        assert registry.get("r1") is None and engine.aborted == []

        background, _ = new_run(engine, grace_seconds=0.01, is_background=True)
        background.attach()
        background.detach()
        await asyncio.sleep(0.05)
        assert engine.aborted == []

    asyncio.run(scenario())


def test_a_held_pump_ends_when_the_engine_ends_the_request():
    async def scenario():
        run, stream = new_run(AbortRecorder(), max_unread_bytes=100)
        await put_words(stream, [f"word{i}" for i in range(20)], last=False)
        assert not run.is_done  # held: nobody reads
        # the engine aborts it (a slow reader, or the grace period): the run must finish, not hang
        stream.put(RequestOutput("r1", 0, finish_reason=FinishReason.ABORT_CLIENT), is_last=True)
        await asyncio.wait_for(run._pump_task, 2)
        assert run.is_done

    asyncio.run(scenario())
