"""`treadle bench serve`'s report: the table it prints and the plot of latency and throughput against
concurrency (also drawn for several servers at once by bench/side_by_side.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def format_table(report: dict[str, Any]) -> str:
    header = ("conc", "reqs", "ok", "req/s", "out tok/s", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99",
              "TPOT p50", "errors")
    rows = [header]
    for lv in report["levels"]:
        ttft, itl, tpot = lv["ttft_ms"], lv["itl_ms"], lv["tpot_ms"]
        errors = ", ".join(f"{k}×{v}" for k, v in sorted(lv["errors"].items())) or "-"
        rows.append((str(lv["concurrency"]), str(lv["num_requests"]), str(lv["num_completed"]),
                     _fmt(lv["request_throughput"], 2), _fmt(lv["output_throughput"]),
                     _fmt(ttft["p50"]), _fmt(ttft["p95"]), _fmt(ttft["p99"]),
                     _fmt(itl["p50"]), _fmt(itl["p95"]), _fmt(itl["p99"]), _fmt(tpot["p50"]), errors))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    knee = report["knee"]
    if knee["concurrency"] is None:
        lines.append(f"knee: none among these levels (P99 {knee['metric']} never grew {knee['threshold']}× faster "
                     f"than throughput)")
    else:
        lines.append(f"knee: concurrency {knee['concurrency']} (P99 {knee['metric']} grew {knee['factor']:.1f}× "
                     f"faster than throughput going to {knee['next_concurrency']})")
    short = [f"{lv['num_short']} at concurrency {lv['concurrency']}" for lv in report["levels"] if lv["num_short"]]
    if short:
        lines.append(f"note: requests that ended before max_tokens ({', '.join(short)}): the server ignored "
                     f"ignore_eos/min_tokens or cut the stream")
    counted = [str(lv["concurrency"]) for lv in report["levels"] if lv["usage_source"] not in ("server", "none")]
    if counted:
        lines.append(f"note: no usage from the server (concurrency {', '.join(counted)}): output tokens counted "
                     f"as text-carrying chunks")
    lines.append("times in ms; ITL per text chunk, TPOT per output token")
    return "\n".join(lines)


def write_plot(runs: dict[str, dict[str, Any]], path: str | Path, title: str | None = None) -> None:
    """One figure: P50/P99 TTFT and ITL against concurrency (left), output tokens/s (right); each
    run's knee marked. `runs` maps a label (a server's name) to its report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from exc

    from matplotlib.lines import Line2D

    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    show_p50 = len(runs) == 1  # with several servers, p50 lines would bury the p99s
    for i, (label, report) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        levels = sorted(report["levels"], key=lambda lv: lv["concurrency"])
        xs = [lv["concurrency"] for lv in levels]
        for metric, style in (("ttft_ms", "-"), ("itl_ms", ":")):
            ax_lat.plot(xs, [lv[metric]["p99"] for lv in levels], style, marker="o", color=color)
            if show_p50:
                ax_lat.plot(xs, [lv[metric]["p50"] for lv in levels], style, marker=".", color=color, alpha=0.4)
        ax_tput.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", color=color, label=label)
        knee = report["knee"]
        if knee["concurrency"] is not None:
            for ax in (ax_lat, ax_tput):
                ax.axvline(knee["concurrency"], color=color, linestyle="--", alpha=0.5)
            ax_tput.annotate(f"knee ({label})" if len(runs) > 1 else "knee", (knee["concurrency"], 0),
                             xycoords=("data", "axes fraction"), xytext=(3, 4 + 11 * i), textcoords="offset points",
                             color=color, fontsize=8)
    styles = [Line2D([], [], color="0.3", linestyle="-", marker="o", label="TTFT p99"),
              Line2D([], [], color="0.3", linestyle=":", marker="o", label="ITL p99")]
    if show_p50:
        styles += [Line2D([], [], color="0.3", alpha=0.4, linestyle="-", marker=".", label="TTFT p50"),
                   Line2D([], [], color="0.3", alpha=0.4, linestyle=":", marker=".", label="ITL p50")]
    ax_lat.legend(handles=styles, fontsize=8, loc="upper left")
    all_levels = sorted({lv["concurrency"] for report in runs.values() for lv in report["levels"]})
    for ax in (ax_lat, ax_tput):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_levels, [str(c) for c in all_levels])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("concurrent streams")
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (ms, log)")
    ax_lat.set_title("TTFT and inter-token latency (ITL)")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_title("output throughput, all streams")
    ax_tput.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
