"""Every architecture against transformers: tiny random models of each (tests/golden/architectures/,
made by scripts/make_golden_architectures.py), loaded as Hugging Face directories.

The reference forward and the exact kernels must give transformers' logits within 1e-3 at every
position of prompts that run past the sliding windows, and the same greedy continuation; the fast
kernels must mostly agree on the top token; each model serves over HTTP through the real server.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.sse import iter_sse_data
from decoding import load_model
from decoding.engine.engine import Engine, EngineConfig
from decoding.engine.params import SamplingParams
from decoding.kernels.reference import forward_logits
from tests.hf_to_gguf import convert
from tests.reliability import running_server
from tests.test_forward_step import StepDriver

GOLDEN = Path(__file__).parent / "golden" / "architectures"
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe", "mixtral"]
LOGIT_TOLERANCE = 1e-3
NEAR_TIE = 2e-3  # a greedy step whose top two logits are this close may go either way within tolerance


def golden(arch: str) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases = json.loads((GOLDEN / arch / "golden.json").read_text())["cases"]
    with np.load(GOLDEN / arch / "golden_logits.npz") as logits:
        return cases, {name: logits[name] for name in logits.files}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_model(request):
    return request.param, load_model(GOLDEN / request.param)


def test_each_directory_loads_as_its_architecture_with_its_switches(arch_model):
    arch, model = arch_model
    cfg = model.config
    assert cfg.architecture == arch
    expected = {
        "llama": dict(rope_neox=True, tied_embeddings=False, has_rope_factors=True, sliding_window=0),
        "mistral": dict(sliding_window=12, tied_embeddings=False),
        "qwen2": dict(qkv_bias=True, qk_norm=False, tied_embeddings=True),
        "qwen3": dict(qk_norm=True, qkv_bias=False, head_dim=32),
        "gemma3": dict(qk_norm=True, post_norms=True, activation="gelu_tanh", head_dim=256, sliding_window=10,
                       sliding_layers=(True, True, False), rope_theta_local=10000.0, attention_scale=128**-0.5),
        "qwen3moe": dict(qk_norm=True, n_experts=16, n_experts_used=4, hidden_dim=32, norm_topk_prob=True),
        "mixtral": dict(n_experts=8, n_experts_used=2, hidden_dim=64, qk_norm=False, tied_embeddings=False),
    }[arch]  # fmt: skip
    has_factors = expected.pop("has_rope_factors", False)
    assert bool(cfg.rope_freq_factors) == has_factors
    for name, value in expected.items():
        assert getattr(cfg, name) == pytest.approx(value), name
    assert model.weights.lm_head is model.weights.token_embedding or not cfg.tied_embeddings


def test_the_tokenizer_encodes_each_prompt_as_transformers_does(arch_model):
    arch, model = arch_model
    for case in golden(arch)[0]:
        assert model.tokenizer.encode(case["text"], add_special_tokens=True) == case["ids"]


def test_the_reference_forward_gives_transformers_logits(arch_model):
    arch, model = arch_model
    cases, logits = golden(arch)
    for i, case in enumerate(cases):
        assert len(case["ids"]) > max(model.config.sliding_window, 1)  # the windows are exercised
        np.testing.assert_allclose(forward_logits(model, case["ids"]), logits[f"case{i}"], atol=LOGIT_TOLERANCE,
                                   rtol=0, err_msg=f"{arch} prompt {i}")  # fmt: skip


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_the_model_step_gives_transformers_logits_in_chunks(arch_model, kernels):
    """Each prompt is prefilled in uneven chunks beside the others, so chunk boundaries fall
    inside and outside the sliding windows."""
    arch, model = arch_model
    cases, logits = golden(arch)
    driver = StepDriver(model, n_threads=2, kernels=kernels)
    try:
        rows: dict[int, list[np.ndarray]] = {i: [] for i in range(len(cases))}
        for i, case in enumerate(cases):
            driver.add(i, case["ids"])
        remaining = {i: len(case["ids"]) for i, case in enumerate(cases)}
        chunk = 5
        while any(remaining.values()):
            work = {i: min(n, chunk + 3 * i) for i, n in remaining.items() if n}
            for i, out in driver.step(work).items():
                rows[i].append(out)
                remaining[i] -= work[i]
            chunk = 13 - chunk  # alternate 5 and 8
    finally:
        driver.close()
    for i in range(len(cases)):
        got, expected = np.concatenate(rows[i]), logits[f"case{i}"]
        if kernels == "exact":
            np.testing.assert_allclose(got, expected, atol=LOGIT_TOLERANCE, rtol=0, err_msg=f"{arch} prompt {i}")
        else:  # int8 activations: llama.cpp-like error; the top token must mostly agree
            agree = np.mean(got.argmax(axis=1) == expected.argmax(axis=1))
            assert agree >= 0.85, f"{arch} prompt {i}: fast kernels' top-1 agrees on {agree:.0%} of positions"


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_the_feed_forward_in_passes_changes_no_logit(arch_model, kernels):
    """Every architecture's switches (biases, head norms, gemma3's post-norms, GELU) through the dense
    feed-forward in passes of 16 tokens: the logits of one pass, bit for bit."""
    arch, model = arch_model
    if model.config.is_moe:
        pytest.skip("a mixture of experts has no dense feed-forward")
    cases, _ = golden(arch)
    results = []
    for rows in (None, 16):
        driver = StepDriver(model, n_threads=2, kernels=kernels, feed_forward_rows=rows)
        try:
            for i, case in enumerate(cases):
                driver.add(i, case["ids"])
            results.append(driver.step({i: len(case["ids"]) for i, case in enumerate(cases)}))
        finally:
            driver.close()
    for i in results[0]:
        np.testing.assert_array_equal(results[1][i], results[0][i], err_msg=f"{arch} prompt {i}")


def test_exact_greedy_decoding_continues_as_transformers_does(arch_model):
    arch, model = arch_model
    engine = Engine(model, EngineConfig(kernels="exact", kv_cache_mb=16, block_size=8)).start()
    try:
        for case in golden(arch)[0]:
            params = SamplingParams(max_tokens=len(case["greedy"]), temperature=0.0, ignore_eos=True)
            tokens = engine.generate(case["ids"], params)[0].token_ids
            for step, (got, expected) in enumerate(zip(tokens, case["greedy"], strict=True)):
                if got != expected:  # only a near tie may differ, and then the rest may too
                    assert case["greedy_margins"][step] < NEAR_TIE, f"{arch}: step {step} differs"
                    break
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_same_weights_from_gguf_give_transformers_logits(arch, tmp_path):
    """Converted as llama.cpp's converter does (tests/hf_to_gguf.py): mistral becomes a llama file
    with permuted Q/K, llama 3's scaling a rope_freqs tensor, Gemma's norms 1 + w."""
    model = load_model(convert(GOLDEN / arch, tmp_path / f"{arch}.gguf"))
    assert model.config.architecture == ("llama" if arch in ("mistral", "mixtral") else arch)
    assert model.config.rope_neox == (arch not in ("llama", "mistral", "mixtral"))
    cases, logits = golden(arch)
    for i, case in enumerate(cases):
        assert model.tokenizer.encode(case["text"], add_special_tokens=True) == case["ids"]
        np.testing.assert_allclose(forward_logits(model, case["ids"]), logits[f"case{i}"], atol=LOGIT_TOLERANCE,
                                   rtol=0, err_msg=f"{arch} prompt {i}")  # fmt: skip


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_streams_transformers_greedy_text_over_http(arch):
    cases, _ = golden(arch)
    case = next(c for c in cases if min(c["greedy_margins"]) >= NEAR_TIE)
    with running_server(["--model", str(GOLDEN / arch), "--kernels", "exact", "--kv-cache-mb", "16"]) as server:
        body = {"model": arch, "prompt": case["ids"], "max_tokens": len(case["greedy"]), "temperature": 0,
                "ignore_eos": True, "stream": True, "skip_special_tokens": False}  # fmt: skip
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            chunks = [json.loads(d) for d in iter_sse_data(response.iter_bytes()) if d != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == case["greedy_text"]
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Hello, world!"}],
                                "max_tokens": 4})  # fmt: skip
        if arch == "gemma3":  # a base model: its directory has no chat template
            assert chat.status_code == 400
            assert "chat template" in chat.json()["error"]["message"]
        else:
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["finish_reason"] in ("length", "stop")
