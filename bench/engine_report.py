"""`treadle bench engine`'s report: the table it prints, treadle beside the peers when they ran."""

from __future__ import annotations

from bench.engine_peers import TRANSFORMERS_BATCH
from bench.speculative import format_speculative


def print_table(r: dict) -> None:
    single = r["single_stream_tokens_per_second"]
    print(f"\n{r['model']} — {r['kernels']} kernels, {r['threads']} pool threads, {r['prompt_tokens']}-token prompts, "
          f"{r['max_tokens']} new tokens each")
    print(f"{'streams':>8} {'tokens/s':>10} {'× single':>9} {'step ms p50':>12} {'python share':>13}")
    for level in r["levels"]:
        ratio = f"{level['tokens_per_second'] / single:8.2f}×" if single else ""
        print(f"{level['concurrency']:>8} {level['tokens_per_second']:>10.1f} {ratio:>9} "
              f"{level['step_ms_median']:>12.2f} {100 * level['python_share']:>12.1f}%")
    print(f"\nprefill: {r['prefill_tokens_per_second']:.0f} tokens/s on a {r['prefill_prompt_tokens']}-token prompt")
    if r["long_prompt_interference"]:
        i = r["long_prompt_interference"]
        print(f"a {i['long_prompt_tokens']}-token prompt arriving while {i['streams']} streams decode: their token gap "
              f"{i['median_gap_ms']:.1f} ms median before, {i['max_gap_ms']:.1f} ms max / {i['p99_gap_ms']:.1f} ms p99 "
              f"during its prefill ({i['stretch']:.2f}× median); its first token after {i['long_prompt_ttft_s']:.2f} s")
        print(f"  (right after its prefill the streams' median gap was {i['median_gap_after_ms']:.1f} ms: "
              f"their contexts grew meanwhile; the p99 gap during it is "
              f"{i['p99_gap_ms'] / i['median_gap_after_ms']:.2f}× that)")
    print(f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s on {r['threads']} threads → roofline "
          f"{r['bandwidth_roofline_tokens_per_second']:.0f}"
          f" tokens/s for one stream ({r['weight_bytes_per_step'] / 1e6:.1f} MB of weights per step)")
    if r.get("numpy_read_bandwidth_gb_s"):
        print(f"  checks, same minute: numpy sum in {r['threads']} threads {r['numpy_read_bandwidth_gb_s']:.1f} GB/s, "
              f"STREAM triad {r['triad_bandwidth_gb_s']:.1f} GB/s")
    if single:
        print(f"single stream reaches {100 * single / r['bandwidth_roofline_tokens_per_second']:.0f}% of it")
    print(f"GEMM {r['gemm_gflops']:.0f} GFLOP/s → compute roofline {r['compute_roofline_tokens_per_second']:.0f}"
          f" tokens/s batched ({r['flops_per_token'] / 1e9:.2f} GFLOP per token)")
    if r.get("int8_gmacs"):
        print(f"int8 VNNI kernels {r['int8_gmacs']:.0f} GMAC/s on {r['threads']} threads (weights in cache, 32 rows) → "
              f"compute roofline {r['int8_roofline_tokens_per_second']:.0f} tokens/s for a batched decode step")
        if r.get("vnni_issue_gmacs"):
            print(f"  check: one 512-bit VNNI instruction per cycle per thread at the reported clock is "
                  f"{r['vnni_issue_gmacs']:.0f} GMAC/s; the kernels reach "
                  f"{100 * r['int8_gmacs'] / r['vnni_issue_gmacs']:.0f}% of it")
    if r["quality"]:
        q = r["quality"]
        print(f"fast vs exact kernels over {q['positions']} positions of real text: top-1 agrees at "
              f"{100 * q['fast_top1_agreement']:.1f}%; greedy 32-token continuations identical for "
              f"{q['greedy_identical_32_tokens']}/{q['greedy_prompts']} prompts "
              f"({100 * q['greedy_token_agreement']:.1f}% of tokens)")
    peer = r["llama_cpp"]
    if peer and "skipped" not in peer:
        single = r["single_stream_tokens_per_second"]
        print(f"llama.cpp {peer['llama_cpp_version']} ({peer['threads']} threads, same GGUF): decode "
              f"{peer['decode_tokens_per_second']:.1f} tokens/s"
              + (f" → treadle {single / peer['decode_tokens_per_second']:.2f}×" if single else "")
              + f"; prompt {peer['prompt_tokens_per_second']:.0f} tokens/s → treadle "
              f"{r['prefill_tokens_per_second'] / peer['prompt_tokens_per_second']:.2f}×")
        if "top1_agreement_with_exact" in peer:
            print(f"llama.cpp top-1 agrees with treadle's exact kernels at "
                  f"{100 * peer['top1_agreement_with_exact']:.1f}%")
    elif peer:
        print(f"llama.cpp: {peer['skipped']}")
    if r["transformers"]:
        print(format_transformers(r))
    if r.get("structured"):
        st = r["structured"]
        print(f"structured output (a {st['schema_fields']}-field JSON schema, compiled in {st['compile_ms']:.0f} ms; "
              "closed loops; ratio: median of paired rounds): "
              + "; ".join(f"{lv['concurrency']} streams {lv['constrained']['tokens_per_second']:.1f} vs "
                          f"{lv['unconstrained']['tokens_per_second']:.1f} tokens/s unconstrained → {lv['ratio']:.2f}× "
                          f"(rounds {min(lv['round_ratios']):.2f}-{max(lv['round_ratios']):.2f}), "
                          f"step {lv['constrained']['step_ms_median']:.2f} vs "
                          f"{lv['unconstrained']['step_ms_median']:.2f} ms"
                          for lv in st["levels"]))
    if r.get("speculative"):
        print(format_speculative(r["speculative"]))
    if r.get("rounds") and "skipped" not in r["rounds"]:
        a = r["rounds"]
        m = a["medians"]
        print(f"alternating with llama.cpp, {a['rounds']} rounds (medians): decode {m['treadle_decode']:.1f} vs "
              f"{m['llama_cpp_decode']:.1f} tokens/s → treadle {a['decode_ratio']:.2f}×; "
              f"prompt {m['treadle_prompt']:.0f} vs "
              f"{m['llama_cpp_prompt']:.0f} → {a['prompt_ratio']:.2f}×")
        print("  per round, decode: " + ", ".join(f"{t:.1f}/{p:.1f}" for t, p in
                                                 zip(a["treadle_decode"], a["llama_cpp_decode"], strict=True)))
    print(f"peak RSS {r['peak_rss_mb']:.0f} MB (model file {r['model_file_mb']:.0f} MB, "
          f"KV cache {r['kv_cache_mb']:.0f} MB)")


def format_transformers(r: dict) -> str:
    """treadle beside transformers: single-stream decode, aggregate decode at TRANSFORMERS_BATCH streams,
    prompt processing, and treadle / transformers (above 1: treadle is faster). treadle's decode figures
    are its levels', whose wall time includes their prompts' prefill; the peer's exclude it."""
    peer = r["transformers"]
    if "skipped" in peer:
        return f"transformers: {peer['skipped']}"
    level = next((lv for lv in r["levels"] if lv["concurrency"] == TRANSFORMERS_BATCH), None)
    rows = [("single-stream decode", r["single_stream_tokens_per_second"], peer["decode_tokens_per_second"]),
            (f"{TRANSFORMERS_BATCH} streams, aggregate", level["tokens_per_second"] if level else None,
             peer["batched_tokens_per_second"].get(str(TRANSFORMERS_BATCH))),
            (f"prompt, {r['prefill_prompt_tokens']} tokens", r["prefill_tokens_per_second"],
             peer["prompt_tokens_per_second"])]
    title = (f"transformers {peer['transformers_version']} (torch {peer['torch_version']}, {peer['dtype']}, "
             f"{peer['threads']} threads, the same weights), tokens/s:")
    lines = [title, f"{'':<26} {'treadle':>9} {'transformers':>13} {'treadle ×':>10}"]
    for name, ours, theirs in rows:
        ratio = f"{ours / theirs:.2f}×" if ours and theirs else "—"
        lines.append(f"{name:<26} {_figure(ours):>9} {_figure(theirs):>13} {ratio:>10}")
    return "\n".join(lines)


def _figure(tokens_per_second: float | None) -> str:
    return f"{tokens_per_second:.1f}" if tokens_per_second else "—"
