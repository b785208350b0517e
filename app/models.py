"""`treadle models`: every registered model name, its architecture, quantization and size, and
whether its file is here (and where) or needs `treadle pull NAME` first."""

from __future__ import annotations

import argparse

from decoding.model.catalog import DEFAULT_MODEL, KNOWN_MODELS, MODELS_DIR_ENV, locate, models_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="treadle models", description=__doc__)
    parser.parse_args(argv)
    rows = [("NAME", "ARCH", "QUANT", "SIZE", "FILE")]
    for name, spec in KNOWN_MODELS.items():
        path = locate(spec)
        rows.append((f"{name} (default)" if name == DEFAULT_MODEL else name, spec.architecture,
                     spec.quantization, f"{spec.size / 1e6:,.1f} MB",
                     str(path) if path is not None else f"not pulled: treadle pull {name}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    print(f"\nmodels directory ({MODELS_DIR_ENV}): {models_dir()}")
    return 0
