"""`treadle bench pool`'s report: the ratios it aims at (TARGETS), and the Markdown tables it prints."""

from __future__ import annotations

from typing import Any

from bench.pool_steps import NUM_OPS, OP_KINDS

TARGETS = {
    "barrier round trip, 2 threads (ns)": ("<=", 200.0),
    "tiny step: omp prange / SpinPool": (">=", 5.0),
    "tiny step: workqueue prange / SpinPool": (">=", 100.0),
    "matvec step: fastest prange / SpinPool": (">=", 1.0),
    "idle pool CPU (% of one core)": ("<=", 1.0),
}


def paired_ratio(layer_results: dict[str, Any], kind: str) -> float | None:
    """prange / SpinPool step time, both measured in alternating blocks in the same subprocess."""
    if "error" in layer_results:
        return None
    return layer_results[kind]["median"] / layer_results[kind + " SpinPool (paired)"]["median"]


def compute_ratios(report: dict[str, Any]) -> dict[str, float | None]:
    layers = {name: measured for name, measured in report["prange_us"].items() if "error" not in measured}
    fastest_matvec_layer = min(layers, key=lambda name: layers[name]["matvec"]["median"], default=None)
    return {
        "barrier round trip, 2 threads (ns)": report["barrier_ns"].get(2, {}).get("median"),
        "tiny step: omp prange / SpinPool": paired_ratio(report["prange_us"].get("omp", {"error": ""}), "tiny"),
        "tiny step: workqueue prange / SpinPool":
            paired_ratio(report["prange_us"].get("workqueue", {"error": ""}), "tiny"),
        "matvec step: fastest prange / SpinPool":
            None if fastest_matvec_layer is None else paired_ratio(layers[fastest_matvec_layer], "matvec"),
        "idle pool CPU (% of one core)": report["idle_cpu_percent"]["parks after 100 us"],
    }


def format_report(report: dict[str, Any]) -> str:
    machine = report["machine"]
    title = (f"# treadle bench pool: {machine['cpu']}, {machine['usable_cores']} cores, numba {machine['numba']}, "
             f"load average {machine['load_average_before']} before, {machine['load_average_after']} after")
    sections = [title, _barrier_table(report), _pool_run_table(report), _steps_table(report),
                _paired_ratio_table(report), _idle_table(report), _asyncio_table(report), _targets_table(report)]
    return "\n\n".join(sections)


def _table(header: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, align, *rows])


def _barrier_table(report: dict[str, Any]) -> str:
    rows = [[f"{num_threads} thread(s)", f"{stats['median']:.0f}", f"{stats['p90']:.0f}"]
            for num_threads, stats in report["barrier_ns"].items()]
    return _table(["barrier episode", "median ns", "p90 ns"], rows)


def _pool_run_table(report: dict[str, Any]) -> str:
    runs = report["pool_run_us"]
    rows = [[label, f"{runs[key]['median']:.1f}", f"{runs[key]['p90']:.1f}"]
            for label, key in (("workers spinning", "spinning"), ("workers parked (wake-up)", "from_parked"))]
    return _table(["pool.run(empty kernel)", "median µs", "p90 µs"], rows)


def _steps_table(report: dict[str, Any]) -> str:
    approaches = {name: {kind: report["steps_us"][kind][name] for kind in OP_KINDS}
                  for name in report["steps_us"]["tiny"]}
    for layer, measured in report["prange_us"].items():
        approaches[f"numba prange, {layer}"] = measured
        if "error" not in measured:
            approaches[f"SpinPool, paired with {layer}"] = {
                kind: measured[kind + " SpinPool (paired)"] for kind in OP_KINDS}
    rows = []
    for name, measured in approaches.items():
        if "error" in measured:
            rows.append([name, f"unavailable: {measured['error'][:60]}", "", "", ""])
            continue
        tiny, matvec = measured["tiny"]["median"], measured["matvec"]["median"]
        rows.append([name, f"{tiny:.1f}", f"{tiny / NUM_OPS:.2f}", f"{matvec:.0f}", f"{matvec / NUM_OPS:.2f}"])
    header = [f"step of {NUM_OPS} ops (median µs)", "tiny (64 floats)", "per op", "matvec 576²", "per op"]
    return _table(header, rows)


def _paired_ratio_table(report: dict[str, Any]) -> str:
    rows = [[f"{layer} (same process, alternating)", f"{paired_ratio(measured, 'tiny'):.2f}",
             f"{paired_ratio(measured, 'matvec'):.2f}"]
            for layer, measured in report["prange_us"].items() if "error" not in measured]
    return _table(["prange step / SpinPool step", "tiny", "matvec"], rows)


def _idle_table(report: dict[str, Any]) -> str:
    rows = [[label, f"{percent:.2f}"] for label, percent in report["idle_cpu_percent"].items()]
    return _table(["idle pool, process CPU", "% of one core"], rows)


def _asyncio_table(report: dict[str, Any]) -> str:
    rows = []
    for label, measured in report["asyncio"].items():
        late, step = measured["loop_lateness_ms"], measured.get("step_ms")
        step_cells = [f"{step['median']:.2f}", f"{step['p99']:.2f}"] if step else ["–", "–"]
        rows.append([label, f"{late['median']:.3f}", f"{late['p99']:.3f}", f"{late['max']:.2f}", *step_cells])
    header = ["asyncio sleep(1 ms) lateness", "p50 ms", "p99 ms", "max ms", "step p50 ms", "step p99 ms"]
    return _table(header, rows)


def _targets_table(report: dict[str, Any]) -> str:
    rows = []
    for name, (relation, wanted) in TARGETS.items():
        value = report["ratios"][name]
        is_met = value is not None and (value <= wanted if relation == "<=" else value >= wanted)
        rows.append([name, "n/a" if value is None else f"{value:.2f}", f"{relation} {wanted:g}",
                     "?" if value is None else ("yes" if is_met else "NO")])
    return _table(["target", "measured", "wanted", "met"], rows)
