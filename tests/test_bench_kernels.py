"""`treadle bench kernels` runs every storage type and reports what it measured (a small matrix)."""

import json

from bench import kernels
from decoding.kernels.repack import is_packable


def test_bench_kernels_reports_every_type_on_its_path(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    assert kernels.main(["--rows", "64", "--cols", "256", "--threads", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [r["in_cache"][0]["type"] for r in report["results"]] == [q.name for q in kernels.TYPES]
    for qtype, result in zip(kernels.TYPES, report["results"], strict=True):
        one, many = result["in_cache"]
        assert (one["tokens"], many["tokens"]) == (1, 32)
        assert one["path"] == ("int8" if is_packable(qtype, 64) else "float32")
        assert one["gmacs"] > 0 and many["gmacs"] > 0 and result["from_dram"]["weight_gbs"] > 0
    assert "Q4_K" in capsys.readouterr().out


def test_a_width_that_is_not_whole_k_blocks_skips_the_k_types_and_says_so(tmp_path, capsys):
    """SmolLM2's rows hold 576 weights: whole 32-blocks, not whole 256-weight super-blocks."""
    path = tmp_path / "kernels.json"
    assert kernels.main(["--rows", "64", "--cols", "96", "--threads", "1", "--json", str(path)]) == 0
    measured = [r["in_cache"][0]["type"] for r in json.loads(path.read_text())["results"]]
    assert "Q4_1" in measured and "Q8_0" in measured and not {"Q4_K", "Q5_K", "Q6_K"} & set(measured)
    assert "skipped" in capsys.readouterr().out
