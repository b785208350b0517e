"""`treadle bench kernels` runs every storage type and reports what it measured (a small matrix)."""

import json

from bench import kernels
from decoding.kernels.repack import is_packable


def test_bench_kernels_reports_every_type_on_its_path(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    assert kernels.main(["--rows", "64", "--cols", "256", "--threads", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [r["in_cache"][0]["type"] for r in report["results"]] == [q.name for q in kernels.TYPES]
    for qtype, result in zip(kernels.TYPES, report["results"]):
        one, many = result["in_cache"]
        assert (one["tokens"], many["tokens"]) == (1, 32)
        assert one["path"] == ("int8" if is_packable(qtype, 64) else "float32")
        assert one["gmacs"] > 0 and many["gmacs"] > 0 and result["from_dram"]["weight_gbs"] > 0
    assert "Q4_K" in capsys.readouterr().out
