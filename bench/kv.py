"""`treadle bench kv`: what paging and prefix caching buy, and what the attention kernel costs.

    .venv/bin/treadle bench kv [--json PATH] [--threads N] [--seed S]
    .venv/bin/treadle bench kv --head-layouts KEYS | --group-kernel | --quality MODEL... [--json PATH]

1. Memory: tokens of KV held per MiB by 64 concurrent chat sequences, paged (16-token blocks)
   against one contiguous max-context buffer per sequence; and with a shared system prompt.
2. Prefix cache: hit rate (prompt tokens found computed / prompt tokens) when multi-turn chats
   are replayed the way clients send them: the whole conversation again, one turn longer each time.
3. Attention: time of one layer's `paged_attention_rows` for decode batches and prefill chunks, over
   a float32, a float16 and an int8 cache (`--kv-cache-dtype`).

Lengths are drawn from seeded log-normal distributions, so every run prints the same figures
for 1 and 2; only the timings of 3 vary with the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from kvcache.attention import attention_scratch, paged_attention_rows, quantize_query_q8
from kvcache.attention_simd import MAX_FLOAT_HEADS, MAX_INT8_HEADS, attend_heads
from kvcache.manager import KVCacheManager
from kvcache.storage import KV_STORAGE_TYPES, MIB, KVCacheSpec

SPEC = KVCacheSpec()  # SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-token blocks
N_HEADS = 9
MAX_MODEL_LEN = 8192
VOCAB_SIZE = 49152
# (batch, context, query rows per sequence)
DECODE_SHAPES = ((1, 512, 1), (1, 8192, 1), (8, 512, 1), (8, 2048, 1), (32, 512, 1), (32, 2048, 1))
PREFILL_SHAPES = ((1, 512, 512), (1, 2048, 512))
CHAT_CACHE_MIB = (256, 1024, None)  # None: a cache that never evicts


def lognormal_lengths(
    rng: np.random.Generator, median: float, sigma: float, size: int, high: int
) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size)), 1, high).astype(int)


def random_tokens(rng: np.random.Generator, num_tokens: int) -> list[int]:
    return rng.integers(0, VOCAB_SIZE, num_tokens).tolist()


def memory_efficiency(
    rng: np.random.Generator, num_seqs: int = 64, system_prompt_len: int = 300
) -> list[dict]:
    """KV bytes for a snapshot of num_seqs chats caught mid-generation."""
    prompt_lens = lognormal_lengths(rng, 500, 0.9, num_seqs, MAX_MODEL_LEN // 2)
    output_lens = lognormal_lengths(rng, 250, 0.8, num_seqs, MAX_MODEL_LEN // 2)
    num_tokens = 1 + prompt_lens + np.rint(rng.uniform(0, 1, num_seqs) * output_lens).astype(int)
    total_tokens = int(num_tokens.sum())
    system_prompt = random_tokens(rng, system_prompt_len)
    rows = [_memory_row("contiguous, max_model_len per sequence", total_tokens, num_seqs * MAX_MODEL_LEN)]
    for label, shared_prefix in (("paged", []), ("paged, shared system prompt", system_prompt)):
        kv = KVCacheManager(num_seqs * MAX_MODEL_LEN // SPEC.block_size, SPEC.block_size, MAX_MODEL_LEN)
        for seq_id, length in enumerate(num_tokens.tolist()):
            token_ids = (shared_prefix + random_tokens(rng, length))[:length]
            num_cached = kv.allocate(seq_id, token_ids[:-1])
            kv.append_slots(seq_id, token_ids[num_cached:-1])
            kv.append_slots(seq_id, token_ids[-1:])  # a decode step: the earlier blocks are now published
        rows.append(_memory_row(label, total_tokens, kv.num_used_blocks * SPEC.block_size))
    return rows


def _memory_row(label: str, num_tokens: int, num_slots: int) -> dict:
    mib = num_slots * SPEC.bytes_per_token / MIB
    return {
        "layout": label,
        "tokens": num_tokens,
        "kv_mib": round(mib, 1),
        "tokens_per_mib": round(num_tokens / mib, 1),
    }


def chat_replay(rng: np.random.Generator, kv_cache_mb: float | None, num_conversations: int = 48) -> dict:
    """Replay interleaved multi-turn chats through a cache of kv_cache_mb (None: never evicts)."""
    num_turns = rng.integers(2, 9, num_conversations)
    system_prompt = random_tokens(rng, 200)
    conversations = [list(system_prompt) for _ in range(num_conversations)]
    arrivals = rng.permutation(np.repeat(np.arange(num_conversations), num_turns))  # turn order kept per chat
    num_blocks = SPEC.num_blocks_for_mib(kv_cache_mb) if kv_cache_mb else 1 << 20
    kv = KVCacheManager(num_blocks, SPEC.block_size, MAX_MODEL_LEN)
    for seq_id, conversation_id in enumerate(arrivals.tolist()):
        conversation = conversations[conversation_id]
        conversation += [1, 2, 3] + random_tokens(
            rng, int(lognormal_lengths(rng, 40, 0.8, 1, 400)[0])
        )  # user
        reply = random_tokens(rng, int(lognormal_lengths(rng, 150, 0.7, 1, 800)[0])) + [4]  # ends with EOS
        num_cached = kv.allocate(seq_id, conversation)
        for start in range(num_cached, len(conversation), 512):  # chunked prefill
            kv.append_slots(seq_id, conversation[start : start + 512])
        for token_id in reply[:-1]:  # decoding computes every reply token but the last one sampled
            kv.append_slots(seq_id, [token_id])
        kv.free(seq_id)
        conversation += reply  # the client sends the reply back in the next turn
    return {
        "kv_cache_mib": kv_cache_mb or "unbounded",
        "requests": kv.stats.num_requests,
        "prompt_tokens": kv.stats.num_query_tokens,
        "hit_tokens": kv.stats.num_hit_tokens,
        "hit_rate": round(kv.stats.hit_rate, 3),
    }


def attention_times(
    rng: np.random.Generator, num_threads: int, prefill: bool = False, repeats: int = 7
) -> list[dict]:
    """Best-of-`repeats` time of one layer's attention (the machines are shared: the minimum is the
    least disturbed run), for decode batches or one prefill chunk at the end of its context.

    With several threads the kernel runs on a Python thread pool (nogil), whose hand-off adds
    ~0.1 ms per call that the engine's spin pool does not.
    """
    rows = []
    with ThreadPoolExecutor(num_threads) as executor:
        for (batch_size, context_len, query_len), dtype in product(
            PREFILL_SHAPES if prefill else DECODE_SHAPES, KV_STORAGE_TYPES
        ):
            spec = KVCacheSpec(dtype=dtype)
            seconds = _time_attention(
                rng, executor, num_threads, batch_size, context_len, query_len, repeats, spec
            )
            num_key_heads = batch_size * N_HEADS * sum(range(context_len - query_len + 1, context_len + 1))
            row = {
                "kv": dtype,
                "batch": batch_size,
                "context": context_len,
                "query_rows": query_len,
                "threads": num_threads,
                "us_per_layer": round(seconds * 1e6, 1),
                "ms_per_step_30_layers": round(seconds * SPEC.n_layers * 1e3, 2),
                "ns_per_key_per_head": round(seconds / num_key_heads * 1e9, 2),
            }
            if prefill:
                row["ms_per_token_30_layers"] = round(seconds * SPEC.n_layers / query_len * 1e3, 3)
            else:  # each decode reads its sequence's whole KV of the layer once
                kv_bytes = batch_size * context_len * spec.bytes_per_token // spec.n_layers
                row["kv_read_gb_s"] = round(kv_bytes / seconds / 1e9, 1)
            rows.append(row)
    return rows


def _time_attention(
    rng: np.random.Generator,
    executor: ThreadPoolExecutor,
    num_threads: int,
    batch_size: int,
    context_len: int,
    query_len: int,
    repeats: int,
    spec: KVCacheSpec,
) -> float:
    """Random K/V in randomly permuted blocks (the worst case for the memory prefetcher)."""
    head_dim, block_size, n_kv_heads = spec.head_dim, spec.block_size, spec.n_kv_heads
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch_size * blocks_per_seq
    key_cache = _stored(rng, (n_kv_heads, num_blocks, spec.row_width, block_size), spec)
    value_cache = _stored(rng, (n_kv_heads, num_blocks, block_size, spec.row_width), spec)
    block_tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch_size, blocks_per_seq)
    context_lens = np.full(batch_size, context_len, dtype=np.int32)
    query_start_loc = np.arange(0, batch_size * query_len + 1, query_len, dtype=np.int32)
    query = rng.standard_normal((batch_size * query_len, N_HEADS, head_dim), dtype=np.float32)
    out = np.empty_like(query)
    scratch = attention_scratch(num_threads, N_HEADS, n_kv_heads, head_dim, block_size)
    args = (out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scratch)
    shape = (np.float32(1.0 / np.sqrt(head_dim)), 0)  # scale (float32, as the step's), no sliding window

    def run_layer() -> None:
        if num_threads == 1:  # no hand-off to time
            paged_attention_rows(*args, 0, 1, *shape)
            return
        futures = [
            executor.submit(paged_attention_rows, *args, tid, num_threads, *shape)
            for tid in range(num_threads)
        ]
        for future in futures:
            future.result()

    run_layer()  # compile or load, and warm the caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_layer()
        times.append(time.perf_counter() - start)
    return min(times)


# (name, query heads, KV heads, head_dim): Qwen2.5's GQA groups of 6, 8 and 7 the vector IR cuts into
# calls, and Gemma 3's heads of 256 in groups of 4 and 2
HEAD_LAYOUTS = (("qwen2.5-1.5b", 12, 2, 128), ("qwen2.5-3b", 16, 2, 128), ("qwen2.5-7b", 28, 4, 128),
                ("gemma-3-1b", 4, 1, 256), ("gemma-3-4b", 8, 4, 256))


def head_layout_times(context_len: int, repeats: int = 15) -> list[dict]:
    """One layer's decode attention of one sequence at `context_len` keys on one thread, in real models'
    head layouts, float16 and int8: best of `repeats`, consecutive block ids. Below ~8k keys a layer's
    KV fits the CPU's caches, so this times the arithmetic; far above, the memory's access too."""
    rng = np.random.default_rng(0)
    rows = []
    for (name, n_heads, n_kv_heads, head_dim), dtype in product(HEAD_LAYOUTS, ("float16", "int8")):
        spec = KVCacheSpec(n_layers=1, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=16, dtype=dtype)
        num_blocks = -(-context_len // 16)
        key_cache = _stored(rng, (n_kv_heads, num_blocks, spec.row_width, 16), spec)
        value_cache = _stored(rng, (n_kv_heads, num_blocks, 16, spec.row_width), spec)
        query = rng.standard_normal((1, n_heads, head_dim), dtype=np.float32)
        args = (np.empty_like(query), query, key_cache, value_cache,
                np.arange(num_blocks, dtype=np.int32)[None, :], np.array([context_len], np.int32),
                np.array([0, 1], np.int32), attention_scratch(1, n_heads, n_kv_heads, head_dim, 16), 0, 1,
                np.float32(1 / np.sqrt(head_dim)), 0)  # fmt: skip
        paged_attention_rows(*args)
        seconds = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            paged_attention_rows(*args)
            seconds = min(seconds, time.perf_counter() - start)
        rows.append({"layout": name, "kv": dtype, "context": context_len, "us_per_layer": round(seconds * 1e6, 1),
                     "ns_per_block_and_kv_head": round(seconds / (num_blocks * n_kv_heads) * 1e9)})  # fmt: skip
    return rows


@njit(nogil=True)
def _fold_blocks(work, heads, key_cache, value_cache, repeats):  # type: ignore[no-untyped-def]
    for _ in range(repeats):
        for block in range(key_cache.shape[1]):
            attend_heads(work, 0, heads, 128, key_cache, value_cache, block, 0, 16, -1, 0)


@njit(nogil=True)
def _fold_block_pairs(work, heads, key_cache, value_cache, repeats):  # type: ignore[no-untyped-def]
    for _ in range(repeats):
        for block in range(0, key_cache.shape[1], 2):
            attend_heads(work, 0, heads, 128, key_cache, value_cache, (block, block + 1), 0, (16, 16), (-1, -1), 0)


def group_kernel_times(blocks: int = 64, repeats: int = 200) -> list[dict]:
    """The vector-IR group kernel alone (`attention_simd.attend_heads`) as the paged kernel calls it:
    16-key blocks of head_dim 128, two a call from an int8 cache (1-8 query heads a call), one from
    a float16 one (1-4), over `blocks` blocks whose tiles stay in L2, best of 7 runs of `repeats`
    passes: the arithmetic a long context's attention is made of, without the memory's time or the
    paged loop's. Times are per block."""
    rng = np.random.default_rng(0)
    rows = []
    for dtype, most_heads, fold, blocks_a_call in (("int8", MAX_INT8_HEADS, _fold_block_pairs, 2),
                                                   ("float16", MAX_FLOAT_HEADS, _fold_blocks, 1)):  # fmt: skip
        spec = KVCacheSpec(n_layers=1, n_kv_heads=1, head_dim=128, block_size=16, dtype=dtype)
        key_cache = _stored(rng, (1, blocks, spec.row_width, 16), spec)
        value_cache = _stored(rng, (1, blocks, 16, spec.row_width), spec)
        for heads in range(1, most_heads + 1):
            work = attention_scratch(1, heads, 1, 128, 16, rows_together=1)[0]
            for g in range(heads):  # a real query's row: scaled, running max -inf, quantized for int8
                work[g, :128] = rng.standard_normal(128, dtype=np.float32) / np.float32(np.sqrt(128))
                work[g, 2 * 128 + 16] = -np.inf
                quantize_query_q8(work[g], 128, 2 * 128 + 16 + 2)
            fold(work, heads, key_cache, value_cache, 1)
            seconds = float("inf")
            for _ in range(7):
                start = time.perf_counter()
                fold(work, heads, key_cache, value_cache, repeats)
                seconds = min(seconds, time.perf_counter() - start)
            per_block = seconds / (repeats * blocks) * 1e9
            rows.append({"kv": dtype, "heads_a_call": heads, "blocks_a_call": blocks_a_call,
                         "ns_per_block": round(per_block, 1), "ns_per_head": round(per_block / heads, 1)})  # fmt: skip
    return rows


def _stored(rng: np.random.Generator, shape: tuple[int, ...], spec: KVCacheSpec) -> np.ndarray:
    """Random normal values as the cache holds them: half floats as their bits; int8 as random values
    with every scale (the last bytes of each (block, head) tile, `kvcache.storage`) the fp16 0.0034
    (bytes 0x22 0x22)."""
    if spec.dtype == "int8":
        x = rng.integers(-127, 128, shape).astype(np.int8)
        tiles = x.reshape(*shape[:-2], -1)
        tiles[..., spec.head_dim * spec.block_size :] = 34
        return x
    x = rng.standard_normal(shape, dtype=np.float32)
    return x.astype(np.float16).view(np.uint16) if spec.dtype == "float16" else x


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench kv", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--threads", type=int, default=1, help="threads for the attention timings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", nargs="+", metavar="MODEL",
                        help="instead: top-1 agreement of an int8 KV cache with a float16 one over real text, "
                             "for each model (a name or a file), with the fast and the exact kernels, beside a "
                             "float32 cache's")  # fmt: skip
    parser.add_argument("--positions", type=int, default=4096, help="positions of text for --quality")
    parser.add_argument("--head-layouts", type=int, metavar="KEYS",
                        help="instead: one layer's decode attention at KEYS keys, one thread, in the Qwen2.5 "
                             "1.5B/3B/7B and Gemma 3 1B/4B head layouts")  # fmt: skip
    parser.add_argument("--group-kernel", action="store_true",
                        help="instead: the group kernel alone, 16-key blocks of head_dim 128 (two a call from "
                             "int8, one from float16), tiles in L2, for each number of query heads a call "
                             "serves")  # fmt: skip
    args = parser.parse_args(argv)
    if args.group_kernel:
        rows = group_kernel_times()
        print_table("The group kernel alone, 16-key blocks of head_dim 128, tiles in L2, ns a block", rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    if args.quality:
        return _kv_quality(args.quality, args.positions, args.json)
    if args.head_layouts:
        rows = head_layout_times(args.head_layouts)
        print_table(f"Decode attention, one layer at {args.head_layouts} keys, one thread", rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    rng = np.random.default_rng(args.seed)
    results: dict[str, Any] = {
        "model": {
            "n_layers": SPEC.n_layers,
            "n_kv_heads": SPEC.n_kv_heads,
            "head_dim": SPEC.head_dim,
            "n_heads": N_HEADS,
            "block_size": SPEC.block_size,
            "max_model_len": MAX_MODEL_LEN,
            "kv_bytes_per_token": SPEC.bytes_per_token,
        },
        "memory": memory_efficiency(rng),
        "prefix_cache": [chat_replay(np.random.default_rng(args.seed), mb) for mb in CHAT_CACHE_MIB],
        "decode_attention": attention_times(rng, args.threads),
        "prefill_attention": attention_times(rng, args.threads, prefill=True, repeats=3),
    }
    print_table("KV memory, 64 chat sequences mid-generation (fp32, 46 KB per token)", results["memory"])
    print_table(
        "Prefix cache, 48 interleaved multi-turn chats with a shared system prompt", results["prefix_cache"]
    )
    print_table(
        "Decode attention, one layer (9 query heads over 3 KV heads of 64)", results["decode_attention"]
    )
    print_table("Prefill attention, one 512-row chunk ending the context", results["prefill_attention"])
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)
        print(f"\nwrote {args.json}")
    return 0


QUALITY_CHUNK = 1024


def llama_cpp_kv_agreement(gguf: Path, positions: int, threads: int = 2) -> dict[str, Any]:
    """llama.cpp's own answer to the same question: `llama-perplexity` over the same text in chunks of
    QUALITY_CHUNK tokens (it scores each chunk's second half), a float16 KV cache's logits as the base,
    then its q8_0 cache (keys and values; keys only; values only) against them: "Same top p"."""
    from bench.engine_quality import corpus_text
    from bench.side_by_side import llama_server_binary

    server = llama_server_binary()
    binary = server.parent / "llama-perplexity" if server else None
    if binary is None or not binary.exists():
        return {"skipped": "llama-perplexity is not built (scripts/build_llama_server.sh builds it)"}
    chunks = max(1, positions // QUALITY_CHUNK)
    with tempfile.TemporaryDirectory() as tmp:
        text, base = Path(tmp) / "corpus.txt", Path(tmp) / "base.kld"
        text.write_text(corpus_text())
        common = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(QUALITY_CHUNK), "--chunks", str(chunks),
                  "-t", str(threads), "-fa", "on", "--kl-divergence-base", str(base)]  # fmt: skip
        subprocess.run(common, capture_output=True, check=True)
        result: dict[str, Any] = {"positions": chunks * QUALITY_CHUNK // 2}
        for label, types in (("k_and_v", ["-ctk", "q8_0", "-ctv", "q8_0"]), ("k_only", ["-ctk", "q8_0"]),
                             ("v_only", ["-ctv", "q8_0"])):  # fmt: skip
            run = subprocess.run([*common, *types, "--kl-divergence"], capture_output=True, text=True, check=True)
            same = re.search(r"Same top p:\s*([\d.]+)", run.stdout + run.stderr)
            result[f"q8_0_{label}_top1_agreement"] = float(same.group(1)) / 100 if same else None
    return result


def _kv_quality(models: list[str], positions: int, json_path: str | None) -> int:
    from bench.engine_quality import kv_cache_agreement
    from decoding import load_model

    rows = []
    for name in models:
        model = load_model(name)
        started = time.perf_counter()
        row = {"model": model.config.name, **kv_cache_agreement(model, positions, chunk=QUALITY_CHUNK)}
        row["seconds"] = round(time.perf_counter() - started, 1)
        print_table(f"{row['model']}: top-1 agreement with the float16 KV cache over {row['positions']} "
                    "positions of real text (float32: the floor the kernels' own sensitivity sets)",
                    [{"kernels": mode, "cache": cache.replace("_", " "), "all": f"{100 * figures['all']:.2f}%",
                      "second halves": f"{100 * figures['second_halves']:.2f}%"}
                     for mode in ("fast", "exact") for cache, figures in row[mode].items()])  # fmt: skip
        if model.path.suffix == ".gguf":
            peer = row["llama_cpp"] = llama_cpp_kv_agreement(model.path, positions)
            if "skipped" in peer:
                print(f"  llama.cpp skipped: {peer['skipped']}")
            else:
                print(f"  llama.cpp's q8_0 cache against its float16 one, the same second halves: keys and values "
                      f"{100 * peer['q8_0_k_and_v_top1_agreement']:.2f}%, keys only "
                      f"{100 * peer['q8_0_k_only_top1_agreement']:.2f}%, values only "
                      f"{100 * peer['q8_0_v_only_top1_agreement']:.2f}%", flush=True)
        rows.append(row)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as file:
            json.dump(rows, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
