"""The engine's configuration: batch and cache sizes, kernel mode, scheduling and slow-reader limits.

Each field is declared once as an option (decoding/engine/options.py): `treadle serve` builds its flags
and environment variables from these declarations, and a value given in code is checked by the same
parser as one given on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels.forward import KERNEL_MODES, int8_kernels
from .options import (
    check_options,
    float_above,
    int_between,
    non_negative_float,
    one_of,
    option,
    or_auto,
    or_none,
    positive_float,
    positive_int,
)

SPECULATIVE_MODES = ("off", "auto", "ngram")
KV_CACHE_DTYPES = ("auto", "float16", "float32", "int8")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = option(64, "sequences decoded together", positive_int)
    max_num_batched_tokens: int = option(
        1024, "tokens per engine step (a wave of prompts is prefilled in few steps, each one long gap for the "
        "streams decoding beside it; 256 gives earlier first tokens and a longer inter-token tail: "
        "docs/performance.md)", positive_int)  # fmt: skip
    kv_cache_mb: float | str = option(
        512.0, "KV cache size in MiB, or `auto`: half of what the memory available (MemAvailable, or the "
        "cgroup's memory.max where lower) leaves beyond the weights and a 300 MiB margin, no more than "
        "--max-num-seqs full-length sequences fill; the log says what it chose. A size that does not fit beside "
        "the weights is refused at start with the sizes, never an out-of-memory kill under load",
        or_auto(positive_float), doc_default="512")  # fmt: skip
    num_kv_blocks: int | None = option(None, "the KV cache's size in blocks, instead of --kv-cache-mb",
                                       or_none(positive_int), doc_default="from --kv-cache-mb")
    block_size: int = option(16, "tokens per KV block", positive_int)
    enable_prefix_caching: bool = option(
        True, "do not reuse the KV blocks of earlier prompts' common prefixes (prefix caching is on by default)",
        doc_default="on")  # fmt: skip
    prefix_cache_ram_mb: float | str = option(
        "auto", "host memory (MiB) keeping the full KV blocks the KV cache evicts, so a prompt that shares "
        "their prefix copies them back instead of computing them; `auto`: a quarter of the memory the weights, "
        "the KV cache and the margin leave, at most 8192; 0: off", or_auto(non_negative_float))  # fmt: skip
    prefix_cache_dir: str | None = option(
        None, "a directory keeping KV blocks on disk across restarts (one file per block, shared safely by "
        "servers of the same model): blocks leaving host memory go there, and every computed block is "
        "written through in the background and on shutdown", or_none(str), doc_default="off")  # fmt: skip
    prefix_cache_disk_mb: float = option(16384.0, "the bound of --prefix-cache-dir, least recently used "
                                                  "blocks removed first", positive_float)  # fmt: skip
    max_queue: int = option(256, "requests admitted at once (running, waiting and being tokenized); more get 429",
                            positive_int)
    n_threads: int | None = option(None, "engine pool threads, at most the usable cores", or_none(positive_int),
                                   flag="--threads", doc_default="every usable core")
    pin_threads: bool = option(True, "do not pin the pool's threads to cores (where the machine is shared and "
                                     "the scheduler should move them)", doc_default="pinned")  # fmt: skip
    max_model_len: int | None = option(None, "the longest sequence served, prompt and output (vLLM's option); at "
                                             "most the model's context", or_none(positive_int),
                                       doc_default="the model's context")  # fmt: skip
    kernels: str = option("fast", "`fast`: int8 activations, VNNI dot products (llama.cpp-like numerics), AMX int8 "
                                  "tiles for 16 tokens at a time where the CPU grants them (the same numbers); "
                                  "`fast-no-amx`: the same without tiles; `exact`: float32 activations, logits within "
                                  "1e-3 of the reference", one_of(KERNEL_MODES))
    weight_cache: bool = option(
        True, "repack the fast kernels' weights at every start and write nothing, instead of mapping them from "
        "the weight cache: a file per GGUF model written at its first start in ~/.cache/treadle/weights/ "
        "(TREADLE_WEIGHT_CACHE_DIR), named after the file's path, size and mtime and the repacking code, older "
        "versions removed; with it a 7B model starts in seconds", doc_default="cache on")  # fmt: skip
    kv_cache_dtype: str = option(
        "auto", "stored KV type: `float16` (half the bytes per token: twice the tokens per MiB, half the reads "
        "per decode; llama.cpp's default), `float32`, `int8` (llama.cpp's q8_0 cache: a fp16 scale per 32 "
        "values, 53% of float16's bytes; queries and keys rotated per 32 by a Walsh-Hadamard transform first, "
        "keys stored less a per-head centre measured at start (docs/kvcache.md); needs heads of a multiple of "
        "32 values; its agreement with float16 is in docs/performance.md); `auto` = "
        "float16 with --kernels fast, float32 with --kernels exact", one_of(KV_CACHE_DTYPES))  # fmt: skip
    max_itl_stretch: float | None = option(
        2.0, "while streams decode, prompt chunks keep a step within this factor of a decode-only step, so "
        "arriving prompts stretch the streams' inter-token gaps at most this much (bursts and short prompts "
        "get more: decoding/engine/scheduler.py); `none`: prompts take whatever the decodes leave",
        or_none(float_above(1.0)))  # fmt: skip
    max_unread_bytes: int | None = option(
        1 << 20, "output a request may hold unread by its client; past it (or once a write to the client has "
        "been blocked for a second) the request pauses, keeping its KV, until the client reads; `none`: no "
        "limit", or_none(positive_int), doc_default="1 MiB")  # fmt: skip
    slow_reader_timeout_seconds: float = option(
        30.0, "a request paused this long for its client is aborted (treadle_slow_reader_aborts_total), and a "
        "stream write blocked this long ends the connection", positive_float)  # fmt: skip
    speculative: str = option(
        "off", "speculative decoding with drafts from the context (n-grams of the prompt and the answer so far; "
        "the output stays what plain decoding gives): `auto` drafts while the measured step costs say a draft "
        "pays, `ngram` always, `off` never (off by default: auto measured 0.85-0.97x of off where drafts are "
        "rarely accepted)", one_of(SPECULATIVE_MODES))  # fmt: skip
    speculative_max_tokens: int = option(8, "the longest draft a sequence verifies in one step", int_between(1, 16))
    priority_starvation_seconds: float | None = option(
        60.0, "a request that has waited this long for admission goes ahead of every priority, in arrival "
        "order, so a low priority delays a request but never starves it; `none`: priorities are strict",
        or_none(positive_float))  # fmt: skip

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV cache's stored type (`auto` follows the kernel mode)."""
        if self.kv_cache_dtype == "auto":
            return "float16" if int8_kernels(self.kernels) else "float32"
        return self.kv_cache_dtype


def resolve_kv_cache_dtype(config: EngineConfig) -> str:
    """The KV cache's stored type for a configuration ("auto" follows the kernel mode)."""
    return config.resolved_kv_cache_dtype
