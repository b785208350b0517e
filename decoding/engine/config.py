"""The engine's configuration: batch and cache sizes, kernel mode, and limits on slow readers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    # A wave of prompts is prefilled in few steps, each a long gap for the streams decoding beside it
    # (decoding/engine/scheduler.py): at 256, the steps of a 32-prompt wave were enough long gaps to
    # reach the streams' 99th-percentile gap. Logit rows are sized alike, allocated untouched.
    max_num_batched_tokens: int = 1024
    kv_cache_mb: float | str = 512.0  # MiB, or "auto": from the memory available (decoding.engine.memory)
    num_kv_blocks: int | None = None  # overrides kv_cache_mb
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_queue: int = 256  # running + waiting requests; more are refused
    n_threads: int | None = None  # None: every usable core
    pin_threads: bool = True
    max_model_len: int | None = None  # None: the model's context
    kernels: str = "fast"  # "fast": int8 activations, VNNI dot products; "exact": float32 activations
    # the fast kernels' repacked matrices mapped from a file of decoding.kernels.weight_cache (written by
    # the first start of a GGUF model) instead of repacked at every start
    weight_cache: bool = True
    # "auto": float16 with the fast kernels (llama.cpp's default KV type), float32 with the exact ones
    # (their logits stay within 1e-3 of the reference); or "float16" / "float32" explicitly, or "int8"
    # (llama.cpp's q8_0 cache: 32 values a fp16 scale, 53% of float16's bytes)
    kv_cache_dtype: str = "auto"
    max_itl_stretch: float | None = 2.0  # prefill chunks keep decode steps within this factor; None: no limit
    # A request whose client leaves this much output unread is not scheduled until the client reads
    # (its KV stays); one that stays so for slow_reader_timeout_seconds is aborted. None: no limit.
    max_unread_bytes: int | None = 1 << 20
    slow_reader_timeout_seconds: float = 30.0
    # Speculative decoding from the context (n-gram drafts, decoding/engine/speculative.py): "auto" drafts
    # while the cost model says a draft pays, "ngram" always drafts, "off" never. Off by default: `auto`
    # ran 0.85-0.96x of off on several workloads (docs/performance.md, speculative decoding).
    speculative: str = "off"
    speculative_max_tokens: int = 8  # the longest draft
    # Admission goes by priority, then arrival; a request that has waited this long goes ahead of every
    # priority (in arrival order), so a low priority delays a request but never starves it. None: never.
    priority_starvation_seconds: float | None = 60.0


SPECULATIVE_MODES = ("off", "auto", "ngram")


KV_CACHE_DTYPES = ("auto", "float16", "float32", "int8")


def resolve_kv_cache_dtype(config: EngineConfig) -> str:
    """The KV cache's stored type for a configuration ("auto" follows the kernel mode)."""
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {config.kv_cache_dtype!r}")
    if config.kv_cache_dtype == "auto":
        return "float16" if config.kernels == "fast" else "float32"
    return config.kv_cache_dtype
