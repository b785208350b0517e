"""`treadle bench sizes`' report: each figure beside its peer and its share of its roof."""

from pathlib import Path

from bench.sizes import report_table


def test_the_sizes_table_gives_each_figure_its_share_of_its_roof():
    costs = {"parameters_b": 1.5, "file_gb": 1.0, "decode_bytes_per_token": 1e9, "read_gb_per_s": 50.0,
             "int8_gmacs": 300.0, "prompt_macs_per_token": 1.5e9, "n_experts": 0}
    runs = {"treadle": {"decode_ms_per_token": 25.0, "aggregate_tokens_per_s": {8: 100.0},
                        "prompt_tokens": 512, "prompt_ttft_ms": 4096.0, "peak_rss_mb": 1753.7,
                        "prefix_ram_mb": 64.0},
            "llama-server": {"decode_ms_per_token": 50.0, "aggregate_tokens_per_s": {8: 50.0},
                             "prompt_tokens": 512, "prompt_ttft_ms": 8192.0, "peak_rss_mb": 2953.7}}
    table = report_table(Path("m.gguf"), costs, runs, [1, 8])
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("|")}
    assert rows["1 stream, share of read roof"] == "| 1 stream, share of read roof | 80% | 40% | 2.00x |"
    # 100 tokens/s × 1.5 GMAC a token = 150 GMAC/s of a 300 GMAC/s roof
    assert rows["8 streams, share of int8 roof"] == "| 8 streams, share of int8 roof | 50% | 25% | 2.00x |"
    assert rows["prompt, share of int8 roof"] == "| prompt, share of int8 roof | 62% | 31% | 2.00x |"
    # peak RSS in MiB, beside the file's 1 GB = 953.7 MiB
    assert rows["peak RSS beyond the file, MiB"] == "| peak RSS beyond the file, MiB | 800 | 2000 | 0.40x |"
    assert rows["of which prefix cache in host memory at the end, MiB"] == (
        "| of which prefix cache in host memory at the end, MiB | 64 | — | — |")
