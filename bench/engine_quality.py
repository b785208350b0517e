"""`treadle bench engine`'s quality check: the fast kernels against the exact ones, top-1 agreement over
real text and greedy continuations (and the exact top-1 that llama.cpp's is compared with)."""

from __future__ import annotations

import importlib
import warnings

import numpy as np

from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.model.model import Model

CORPUS_MODULES = ("argparse", "json", "logging", "textwrap", "typing", "unittest", "email", "collections", "inspect",
                  "pickle")


def corpus_text() -> str:
    """Real English text written by people: the standard library's module documentation, then (for more
    than its ~3,000 tokens) the documentation of those modules' public classes and functions."""
    modules = [importlib.import_module(name) for name in CORPUS_MODULES]
    parts = [module.__doc__ or "" for module in modules]
    for module in modules:
        for name in sorted(vars(module)):
            with warnings.catch_warnings():  # typing.io and typing.re warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                member = getattr(module, name)
                doc, home = getattr(member, "__doc__", None), getattr(member, "__module__", None)
            if not name.startswith("_") and home == module.__name__ and doc:
                parts.append(doc)
    return "\n\n".join(parts)


def quality_corpus(model: Model, num_tokens: int, chunk: int = 512) -> list[list[int]]:
    """`num_tokens` of `corpus_text()` as token ids, cut in chunks."""
    ids = model.tokenizer.encode(corpus_text())[:num_tokens]
    return [ids[i : i + chunk] for i in range(0, len(ids) - 1, chunk)]


def top1_predictions(engine: Engine, chunks: list[list[int]]) -> list[list[int]]:
    """The model's argmax after every position of every chunk (prompt logprobs, then the sampled token)."""
    result = []
    for ids in chunks:
        out = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        result.append([lp.top[0][0] for lp in out.prompt_logprobs[1:]] + [out.token_ids[0]])
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=False)]
    return sum(x == y for x, y in pairs) / len(pairs)


def measure_quality(model: Model, num_tokens: int) -> dict:
    """Fast kernels against exact ones: top-1 agreement over real text and greedy continuations."""
    chunks = quality_corpus(model, num_tokens)
    predictions, greedy = {}, {}
    prompts = [ids[:48] for ids in chunks]
    for kernels in ("exact", "fast"):
        engine = Engine(model, EngineConfig(kv_cache_mb=256, kernels=kernels, enable_prefix_caching=False)).start()
        try:
            predictions[kernels] = top1_predictions(engine, chunks)
            greedy[kernels] = [engine.generate(p, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
                               .token_ids for p in prompts]
        finally:
            engine.shutdown()
    identical = sum(a == b for a, b in zip(greedy["fast"], greedy["exact"], strict=True))
    return {"positions": sum(len(c) for c in chunks), "chunks": chunks, "exact_top1": predictions["exact"],
            "fast_top1_agreement": agreement(predictions["fast"], predictions["exact"]),
            "greedy_prompts": len(prompts), "greedy_identical_32_tokens": identical,
            "greedy_token_agreement": agreement(greedy["fast"], greedy["exact"])}


def kv_cache_agreement(model: Model, num_tokens: int, chunk: int = 1024,
                       kernels: tuple[str, ...] = ("fast", "exact")) -> dict:  # fmt: skip
    """Top-1 agreement over real text of the int8 KV cache with the float16 one: how much the cheaper
    cache changes what the model predicts, position by position, for each of `kernels`. Beside it, the
    same measure of a float32 cache, which holds every value more precisely than float16: the floor
    that a kernel mode's own sensitivity sets (the fast kernels quantize every activation to int8, so a
    change in the last bit of an attention output can flip a near-tie downstream). The served int8
    cache (keys centred, kvcache.key_centres) is also measured with no centres under the fast kernels."""
    chunks = quality_corpus(model, num_tokens, chunk)

    def predictions(dtype: str, mode: str, centred: bool = True) -> list[list[int]]:
        engine = Engine(model, EngineConfig(kv_cache_mb=256, kv_cache_dtype=dtype, kernels=mode,
                                            enable_prefix_caching=False, max_num_batched_tokens=chunk))
        if not centred:
            engine.runner.set_key_centres(np.zeros_like(engine.runner.weights.arrays.key_centres))
        engine.start()
        try:
            return top1_predictions(engine, chunks)
        finally:
            engine.shutdown()

    def second_halves(rows: list[list[int]]) -> list[list[int]]:  # the positions llama-perplexity scores
        return [row[chunk // 2 :] for row in rows]

    def compared(rows: list[list[int]], base: list[list[int]]) -> dict[str, float]:
        return {"all": agreement(rows, base), "second_halves": agreement(second_halves(rows), second_halves(base))}

    result: dict = {"positions": sum(len(c) for c in chunks), "reference": "float16"}
    for mode in kernels:
        base = predictions("float16", mode)
        result[mode] = {"int8": compared(predictions("int8", mode), base),
                        "float32": compared(predictions("float32", mode), base)}
        if mode == "fast":
            result[mode]["int8_no_key_centres"] = compared(predictions("int8", mode, centred=False), base)
    return result
