"""How much memory a server may take, and the KV cache budget that leaves (`--kv-cache-mb auto`).

The weights stay resident (their repacked copy, or the mapped file), the KV arrays are touched at
start (kvcache.storage), and what is left must serve everything else. So before anything is
allocated, the engine checks that weights + KV cache + a margin fit in the memory available — the
kernel's MemAvailable (free memory plus what it can reclaim, the page cache included), or what the
process's cgroup still allows where that is less — and refuses to start with the sizes named, rather
than be killed for memory under load. `auto` gives the KV cache half of what the weights and the
margin leave (the other half stays for the page cache, other processes and a host-memory prefix
tier), and never more than `max_num_seqs` sequences of the longest length could fill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache.storage import KVCacheSpec

    from .config import EngineConfig

log = logging.getLogger(__name__)

MIB = 1 << 20
# the process besides weights and KV: the interpreter, tokenizer, scratch of a step, HTTP buffers
RUNTIME_MARGIN_BYTES = 300 * MIB
AUTO_SHARE = 0.5


class NotEnoughMemory(MemoryError):
    """The model and its KV cache do not fit in the memory available; the message gives the sizes."""


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    available: int  # bytes the process may still take
    source: str  # where `available` comes from, for messages


def _meminfo_bytes(field: str, meminfo: Path) -> int | None:
    for line in meminfo.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    return None


def _cgroup_room(cgroup: Path) -> int | None:
    """What the cgroup v2 limit still allows (memory.max - memory.current), or None without a limit."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> MemoryBudget:
    available = _meminfo_bytes("MemAvailable", meminfo)
    if available is None:  # not Linux, or a kernel older than 3.14: nothing to check against
        return MemoryBudget(1 << 62, "unknown")
    room = _cgroup_room(cgroup)
    if room is not None and room < available:
        return MemoryBudget(room, "the cgroup's memory.max")
    return MemoryBudget(available, "MemAvailable")


def auto_kv_bytes(weights_bytes: int, most_useful_bytes: int, budget: MemoryBudget) -> int:
    """The KV cache `auto` picks: half of what the weights and the margin leave, at most what the
    sequences could ever fill (`most_useful_bytes`)."""
    spare = budget.available - weights_bytes - RUNTIME_MARGIN_BYTES
    return max(0, min(int(spare * AUTO_SHARE), most_useful_bytes))


def check_fits(weights_bytes: int, kv_bytes: int, budget: MemoryBudget) -> None:
    needed = weights_bytes + kv_bytes + RUNTIME_MARGIN_BYTES
    if needed > budget.available:
        raise NotEnoughMemory(
            f"the model's weights ({weights_bytes / MIB:,.0f} MiB) and a KV cache of {kv_bytes / MIB:,.0f} "
            f"MiB, with {RUNTIME_MARGIN_BYTES / MIB:.0f} MiB for the rest of the process, need "
            f"{needed / MIB:,.0f} MiB; {budget.available / MIB:,.0f} MiB is available ({budget.source}). "
            "Lower --kv-cache-mb, or use --kv-cache-mb auto"
        )


def num_kv_blocks(cfg: EngineConfig, spec: KVCacheSpec, weights_bytes: int, max_model_len: int) -> int:
    """The KV cache's size in blocks, from the configuration: refused where the weights and the
    cache do not fit in the memory available."""
    budget = available_memory()
    if cfg.num_kv_blocks:
        num_blocks = cfg.num_kv_blocks
    elif cfg.kv_cache_mb == "auto":
        most_useful = cfg.max_num_seqs * max_model_len * spec.bytes_per_token
        num_blocks = auto_kv_bytes(weights_bytes, most_useful, budget) // spec.bytes_per_block
        log.info("KV cache (auto): %d blocks, %.0f MiB, %d tokens — half of the %.0f MiB available (%s) "
                 "beyond %.0f MiB of weights and a %.0f MiB margin, at most what %d sequences of %d tokens fill",
                 num_blocks, num_blocks * spec.bytes_per_block / MIB, num_blocks * spec.block_size,
                 budget.available / MIB, budget.source, weights_bytes / MIB,
                 RUNTIME_MARGIN_BYTES / MIB, cfg.max_num_seqs, max_model_len)  # fmt: skip
        if num_blocks < 1:
            check_fits(weights_bytes, spec.bytes_per_block, budget)
            raise NotEnoughMemory("no KV block fits beside the weights in the memory available")
    else:
        num_blocks = spec.num_blocks_for_mib(float(cfg.kv_cache_mb))
    check_fits(weights_bytes, num_blocks * spec.bytes_per_block, budget)
    return num_blocks


# The host-memory prefix tier's `auto` size: a share of what the weights, the KV cache and the margin
# leave, at most llama.cpp's default prompt cache in RAM (--cache-ram 8192).
PREFIX_RAM_SHARE = 0.25
PREFIX_RAM_MAX_BYTES = 8192 * MIB


def prefix_ram_bytes(cfg: EngineConfig, weights_bytes: int, kv_bytes: int) -> int:
    """The bound of the host-memory prefix tier (it fills only as the KV pool evicts blocks)."""
    if cfg.prefix_cache_ram_mb != "auto":
        return int(float(cfg.prefix_cache_ram_mb) * MIB)
    budget = available_memory()
    spare = budget.available - weights_bytes - kv_bytes - RUNTIME_MARGIN_BYTES
    return max(0, min(int(spare * PREFIX_RAM_SHARE), PREFIX_RAM_MAX_BYTES))
