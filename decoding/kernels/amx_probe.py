"""Whether this process may use AMX int8 tiles (decoding.kernels.amx), and why not where it may not.

Three things must hold: the CPU lists AMX and the OS saves its state (LLVM's host features say both); Linux
grants this process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; without it the
first tile instruction is SIGILL); and the tile kernels give the VNNI kernels' numbers bit for bit on this
machine. The last is checked in a child process, because on a guest that lists AMX without granting it a tile
instruction kills the process: a server must not be the one to find out. Its verdict is kept beside numba's
kernel cache (keyed by the source tree, the CPU and the kernel release), so only a first start pays the
seconds it takes. TREADLE_NO_AMX=1 turns the tiles off as `--kernels fast-no-amx` does.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llvmlite import binding

ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


@dataclass(frozen=True)
class TileSupport:
    available: bool  # the CPU lists AMX int8 and Linux granted this process the tile state
    granted: bool  # available, and the tile kernels gave the VNNI kernels' bits: the fast kernels use them
    reason: str  # why not, or what was checked


def cpu_lists_amx() -> bool:
    features = binding.get_host_cpu_features()
    return bool(features.get("amx-tile", False) and features.get("amx-int8", False))


def request_tile_permission() -> str | None:
    """Ask Linux for the tile data state for this process; None when granted, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {os.strerror(ctypes.get_errno())}"
    return None


def _verdict_path() -> Path:
    from threadpool.numba_cache import numba_cache_dir

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")  # fmt: skip
    key = f"{model}|{platform.release()}".encode()
    return numba_cache_dir() / f"amx-verdict-{hashlib.sha256(key).hexdigest()[:16]}.json"


def _check_in_child() -> str | None:
    """Run `check_tiles` in a child process; None when the tiles gave the VNNI kernels' bits, else why not."""
    try:
        child = subprocess.run([sys.executable, "-m", "decoding.kernels.amx_probe"], capture_output=True, text=True,
                               timeout=600, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    except subprocess.TimeoutExpired:
        return "the tile kernels' check did not finish in 600 s"
    if child.returncode == 0:
        return None
    tail = (child.stdout + child.stderr).strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
    return f"the tile kernels' check failed ({'signal ' + str(-child.returncode) if child.returncode < 0 else tail[0]})"


@functools.cache
def tile_support() -> TileSupport:
    """Whether the fast kernels may run through AMX tiles in this process (asks Linux for them if so)."""
    if os.environ.get("TREADLE_NO_AMX"):
        return TileSupport(False, False, "TREADLE_NO_AMX is set")
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return TileSupport(False, False, "not Linux on x86-64")
    if not cpu_lists_amx():
        return TileSupport(False, False, "the CPU does not list AMX int8 tiles (or the OS does not save their state)")
    refused = request_tile_permission()
    if refused:
        return TileSupport(False, False, refused)
    path = _verdict_path()
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        verdict = {"failure": _check_in_child()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict))
    if verdict["failure"]:
        return TileSupport(True, False, verdict["failure"])
    return TileSupport(True, True, "AMX int8 tiles granted; the tile kernels gave the VNNI kernels' bits")


def check_tiles(mode: int | None = None) -> list[str]:
    """Every packed type through the hardware tiles (or `mode`: the emulation, to test this check) against the
    VNNI kernels: the mismatches (empty if none)."""
    import numpy as np

    from decoding.kernels.amx import HARDWARE, TILE_TOKENS, tile_activations, tile_scratch
    from decoding.kernels.fast_kernels import activation_arrays, matmul_groups, quantize_activation_rows
    from decoding.kernels.repack import repack
    from decoding.kernels.vnni import GROUP_ROWS, MOST_GROUP_TOKENS
    from decoding.model.quant import BLOCK_SHAPES, FP16_FIELDS, QType

    mode = HARDWARE if mode is None else mode
    rng = np.random.default_rng(0)
    rows, cols, tokens = 16, 512, 35
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    mismatches = []
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q6_K, QType.Q4_K):
        per_block, size = BLOCK_SHAPES[qtype]  # random blocks: every quantized bit random, scales in (0.01, 0.02)
        blocks = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
        for offset in FP16_FIELDS[qtype]:
            scales = (0.01 * (1 + rng.random(blocks.shape[:2]))).astype(np.float16)
            blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
        packed = repack(blocks.reshape(rows, -1), qtype, rows, cols)
        results = []
        for tiles_mode in (0, mode):
            xq, xd, xsum = activation_arrays(tokens, cols)
            tiles = tile_activations(tiles_mode, tokens, cols, TILE_TOKENS)
            quantize_activation_rows(x, cols, 0, tokens, xq, xd, xsum, tiles, tokens)
            out = np.zeros((tokens, rows), np.float32)
            matmul_groups(packed, int(qtype), cols, xq, xd, xsum, tokens, out, 0, rows // 8, False,
                          np.zeros((MOST_GROUP_TOKENS, GROUP_ROWS), np.float32), tiles,
                          tile_scratch(1, tiles_mode, cols, tokens)[0, 0])
            results.append(out)
        if not np.array_equal(results[0].view(np.int32), results[1].view(np.int32)):
            mismatches.append(f"{qtype.name}: {int((results[0] != results[1]).sum())} of {results[0].size} differ")
    return mismatches


if __name__ == "__main__":
    refused = request_tile_permission()
    if refused:
        print(refused)
        sys.exit(2)
    from threadpool.numba_cache import use_numba_cache

    use_numba_cache()
    failures = check_tiles()
    print("; ".join(failures) if failures else "the tiles gave the VNNI kernels' bits")
    sys.exit(1 if failures else 0)
