"""The side-by-side benchmark's pieces that need no servers: the peers' commands, the table's rows and
ratios, and the churn benchmark's weighted gap percentiles."""

from __future__ import annotations

from pathlib import Path

from bench.churn import StepRecord, gap_summary, phase_summary, weighted_percentiles
from bench.side_by_side import PEERS, _llama_server, ratio_table
from decoding.kernels.phases import PHASES


def report(tokens_per_s: float, ttft: float, itl_p99: float) -> dict:
    def dist(p50: float, p99: float) -> dict:
        return {"p50": p50, "p95": p99, "p99": p99, "mean": p50}

    return {"levels": [{"concurrency": 1, "num_completed": 8, "output_throughput": tokens_per_s / 10,
                        "tpot_ms": dist(1000 / (tokens_per_s / 10), 0), "ttft_ms": dist(ttft, ttft),
                        "itl_ms": dist(5, 6)},
                       {"concurrency": 32, "num_completed": 64, "output_throughput": tokens_per_s,
                        "tpot_ms": dist(50, 60), "ttft_ms": dist(ttft * 10, ttft * 20), "itl_ms": dist(40, itl_p99)}]}


def test_the_table_has_the_issue_rows_and_treadle_over_peer_ratios():
    table = ratio_table({"treadle": report(600, 50, 120), "llama-server": report(200, 150, 130)}, [1, 32])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert list(rows) == ["1 stream: decode tokens/s (1 / TPOT p50)", "1 stream: TTFT p50 ms",
                          "32 streams: aggregate output tokens/s", "32 streams: TTFT p50 ms",
                          "32 streams: TTFT p99 ms", "32 streams: inter-token p50 ms", "32 streams: inter-token p99 ms"]
    assert "**3.00**" in rows["32 streams: aggregate output tokens/s"]
    assert "**0.92**" in rows["32 streams: inter-token p99 ms"]  # 120 / 130: below 1 is better for latencies


def test_llama_server_runs_as_many_slots_as_streams_and_the_one_at_a_time_server_only_one(monkeypatch, tmp_path):
    binary = tmp_path / "llama-server"
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    argv = _llama_server(8080, Path("m.gguf"), 2, slots=32)
    assert argv[0] == str(binary)
    assert argv[argv.index("--parallel") + 1] == "32" and argv[argv.index("--ctx-size") + 1] == "16384"
    assert argv[argv.index("--threads") + 1] == "2" == argv[argv.index("--threads-batch") + 1]
    assert PEERS["llama-cpp-python"].max_concurrency == 1 and PEERS["llama-server"].max_concurrency is None


def test_gaps_count_each_step_once_per_decode_and_split_by_prefill():
    assert weighted_percentiles([10.0, 100.0], [99, 1], (50, 99, 100)) == [10.0, 10.0, 100.0]

    def step(cycle: float, decodes: int, prefill: int) -> StepRecord:
        return StepRecord(0.0, cycle, cycle, cycle / 2, decodes, 0, prefill, int(prefill > 0), prefill)

    records = [step(50, 32, 0)] * 90 + [step(200, 32, 400)] * 10
    gaps = gap_summary(records)
    assert gaps["decode_only"]["p99_ms"] == 50 and gaps["with_prefill"]["p50_ms"] == 200
    assert gaps["all"]["p99_ms"] == 200 and gaps["all"]["tokens"] == 3200
    assert gaps["prefill_tokens_per_prefill_step"] == {"p50": 400.0, "max": 400}


def test_phase_summary_splits_each_kind_of_step_by_its_cycles():
    def step(kernel_ms: float, decodes: int, prefill: int, cycles: list[int] | None) -> StepRecord:
        return StepRecord(0.0, kernel_ms, kernel_ms, kernel_ms, decodes, 0, prefill, int(prefill > 0), prefill, cycles)

    attention, lm_head = PHASES.index("paged attention"), PHASES.index("lm head")
    decode_cycles = [0] * len(PHASES)
    decode_cycles[attention], decode_cycles[lm_head] = 300, 100
    prefill_cycles = [0] * len(PHASES)
    prefill_cycles[attention] = 1000
    assert phase_summary([step(40.0, 32, 0, None)]) is None
    summary = phase_summary([step(40.0, 32, 0, decode_cycles), step(60.0, 32, 0, decode_cycles),
                             step(80.0, 30, 50, prefill_cycles)])
    plain, shared = summary["decode_only"], summary["with_prefill"]
    assert plain["steps"] == 2 and plain["kernel_ms"] == 50.0
    assert plain["phases"]["paged attention"] == {"share": 0.75, "ms": 37.5}
    assert plain["phases"]["lm head"]["ms"] == 12.5 and plain["phases"]["embed"]["share"] == 0.0
    assert shared["steps"] == 1 and shared["phases"]["paged attention"]["ms"] == 80.0
