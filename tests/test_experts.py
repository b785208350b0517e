"""Mixtures of experts in the model step (decoding.kernels.experts): routing as the reference routes,
pairs grouped by expert, and the tiny transformers qwen3moe and Mixtral models stored quantized as
llama-quantize would store them, so the fast kernels run repacked experts — each against the
reference forward in mixed batches, and batch- and thread-invariant in both kernel modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from decoding import load_model
from decoding.kernels.experts import group_by_expert, route_tokens
from decoding.kernels.reference import route
from decoding.model.quant import QType
from tests.hf_to_gguf import convert
from tests.test_forward_step import StepDriver, assert_logits_alone_equal_logits_beside, check_mixed_batches

GOLDEN = Path(__file__).parent / "golden" / "architectures"


@pytest.mark.parametrize("normalise", [True, False])
def test_routing_chooses_and_weighs_the_experts_the_reference_does(normalise):
    rng = np.random.default_rng(3)
    n_tokens, n_experts, dim, n_used = 40, 16, 64, 4
    h = rng.standard_normal((n_tokens, dim)).astype(np.float32)
    router = (rng.standard_normal((n_experts, dim)) / 8).astype(np.float32)
    scores = np.zeros((n_tokens, n_experts), np.float32)
    choices = np.zeros((n_tokens, n_used), np.int64)
    weights = np.zeros((n_tokens, n_used), np.float32)
    route_tokens(h, router, n_used, normalise, 0, n_tokens, scores, choices, weights)
    expected_choices, expected_weights = route(h, router, n_used, normalise)
    np.testing.assert_array_equal(choices, expected_choices)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6, rtol=0)
    assert np.all(np.diff(weights, axis=1) <= 0)  # best first
    if normalise:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-6)


def test_tied_scores_choose_the_lower_index_first():
    h = np.ones((1, 32), np.float32)
    router = np.zeros((6, 32), np.float32)
    router[[1, 4]] = 0.5  # two equal best, then four equal rest
    scores, choices, weights = np.zeros((1, 6), np.float32), np.zeros((1, 3), np.int64), np.zeros((1, 3), np.float32)
    route_tokens(h, router, 3, True, 0, 1, scores, choices, weights)
    assert choices.tolist() == [[1, 4, 0]]


def test_pairs_are_grouped_by_expert_then_token_and_each_choice_knows_its_place():
    choices = np.array([[2, 0], [0, 3], [2, 3], [1, 0]], np.int64)
    n_experts, n_used = 5, 2
    offsets, cursor = np.zeros(n_experts + 1, np.int64), np.zeros(n_experts, np.int64)
    pair_token, pair_of = np.full(8, -1, np.int64), np.full(8, -1, np.int64)
    group_by_expert(choices, 4, n_experts, offsets, cursor, pair_token, pair_of)
    assert offsets.tolist() == [0, 3, 4, 6, 8, 8]  # expert 4 has no tokens
    assert pair_token.tolist() == [0, 1, 3, 3, 0, 2, 1, 2]
    for t in range(4):
        for j in range(n_used):
            e = choices[t, j]
            assert offsets[e] <= pair_of[t * n_used + j] < offsets[e + 1]
            assert pair_token[pair_of[t * n_used + j]] == t


@pytest.fixture(scope="module", params=[("qwen3moe", QType.Q8_0), ("mixtral", QType.Q4_0), ("qwen3moe", QType.F32)],
                ids=lambda p: f"{p[0]}-{p[1].name}")
def quantized_moe(request, tmp_path_factory):
    arch, qtype = request.param
    path = convert(GOLDEN / arch, tmp_path_factory.mktemp("moe") / f"{arch}-{qtype.name}.gguf", qtype)
    model = load_model(path)
    assert model.config.is_moe and model.weights.layers[0].w_gate.qtype == qtype
    return model


def test_exact_kernels_give_the_reference_logits_in_mixed_batches(quantized_moe):
    check_mixed_batches(quantized_moe, 2, atol=1e-3)


def test_fast_kernels_stay_close_to_the_reference_in_mixed_batches(quantized_moe):
    check_mixed_batches(quantized_moe, 2, atol=0.05, kernels="fast")


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_a_tokens_logits_do_not_depend_on_its_batch_or_the_thread_count(quantized_moe, kernels):
    """A prompt alone, beside a longer one (whose tokens choose other experts too), on one or two
    threads: the same logits bit for bit."""
    rng = np.random.default_rng(8)
    vocab = quantized_moe.config.vocab_size
    ids, other = rng.integers(5, vocab, 19).tolist(), rng.integers(5, vocab, 41).tolist()
    assert_logits_alone_equal_logits_beside(quantized_moe, kernels, ids, other)


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_token_by_token_gives_the_one_step_prefills_logits(quantized_moe, kernels):
    """One token a step (each of its experts run for a single row) and the whole prompt in one step
    (experts shared by many rows): the same logits bit for bit."""
    ids = np.random.default_rng(2).integers(5, quantized_moe.config.vocab_size, 9).tolist()
    rows = {}
    for name, chunks in (("whole", [9]), ("single", [1] * 9)):
        driver = StepDriver(quantized_moe, 2, kernels=kernels)
        try:
            driver.add(1, ids)
            rows[name] = np.concatenate([driver.step({1: n})[1] for n in chunks])
        finally:
            driver.close()
    np.testing.assert_array_equal(rows["single"], rows["whole"])


def test_a_token_reads_its_chosen_experts_share_of_the_expert_weights(quantized_moe):
    from decoding.kernels.forward import bytes_read_per_token, resident_weight_bytes

    cfg, weights = quantized_moe.config, quantized_moe.weights
    experts = sum(m.nbytes for layer in weights.layers for m in (layer.w_gate, layer.w_up, layer.w_down))
    routers = sum(layer.router.nbytes for layer in weights.layers)
    everything = resident_weight_bytes(weights, fast=False)
    assert bytes_read_per_token(cfg, weights, fast=False) == (
        everything - experts + experts * cfg.n_experts_used // cfg.n_experts + routers)


def test_the_share_of_experts_a_step_reads_grows_with_its_tokens():
    from bench.sizes import expert_share

    assert expert_share(128, 8, 1) == pytest.approx(8 / 128)
    assert expert_share(128, 8, 8) == pytest.approx(1 - (120 / 128) ** 8)  # 40%
    assert expert_share(128, 8, 32) > 0.87 > expert_share(128, 8, 8)


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, "dense feed-forward inside a mixture"),
    ({"decoder_sparse_step": 2}, "dense feed-forward inside a mixture"),
    ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ({"num_experts_per_tok": 17}, "17 experts used per token of 16"),
])  # fmt: skip
def test_a_mixture_treadle_cannot_run_is_refused_at_load_with_why(tmp_path, change, message):
    import json
    import shutil

    from decoding.model.errors import ModelLoadError

    directory = tmp_path / "qwen3moe"
    shutil.copytree(GOLDEN / "qwen3moe", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(directory)


@pytest.mark.parametrize("arch, as_gguf", [("qwen3moe", False), ("mixtral", True)])
def test_each_mixture_streams_transformers_greedy_text_through_the_openai_client(arch, as_gguf, tmp_path):
    """`treadle serve` on the directory (or its GGUF conversion), exact kernels, streamed by the
    official client: transformers' greedy continuation, token for token."""
    import json

    import openai

    from tests.reliability import running_server
    from tests.test_architectures import NEAR_TIE, golden

    cases, _ = golden(arch)
    case = next(c for c in cases if min(c["greedy_margins"]) >= NEAR_TIE)
    model = convert(GOLDEN / arch, tmp_path / f"{arch}.gguf") if as_gguf else GOLDEN / arch
    with running_server(["--model", str(model), "--kernels", "exact", "--kv-cache-mb", "16"]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model=arch, prompt=case["ids"], max_tokens=len(case["greedy"]),
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == case["greedy_text"], json.dumps(case["greedy_text"])


def test_experts_stacked_as_transformers_5_holds_them_load_as_the_per_expert_checkpoint(tmp_path):
    """Qwen3-MoE's experts as one `gate_up_proj` (E, 2·width, dim) and one `down_proj` per layer."""
    import json
    import shutil
    import struct

    from decoding.kernels.reference import forward_logits
    from decoding.model.safetensors_loader import map_safetensors
    from decoding.model.weights import WeightMatrix

    source = GOLDEN / "qwen3moe"
    cfg = json.loads((source / "config.json").read_text())
    n_experts = cfg["num_local_experts"]
    tensors = {name: WeightMatrix(qtype, 1, data.size, data.reshape(1, -1)).dequantize().reshape(data.shape)
               for name, (data, qtype) in map_safetensors(source / "model.safetensors").items()}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}.mlp.experts."
        parts = {n: np.stack([tensors.pop(f"{prefix}{e}.{n}.weight") for e in range(n_experts)])
                 for n in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        tensors[prefix + "gate_up_proj"] = np.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
        tensors[prefix + "down_proj"] = parts["down_proj"]
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    directory = tmp_path / "qwen3moe-stacked"
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    encoded = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
    ids = json.loads((source / "golden.json").read_text())["cases"][0]["ids"]
    np.testing.assert_allclose(forward_logits(load_model(directory), ids), forward_logits(load_model(source), ids),
                               atol=1e-5, rtol=0)  # fmt: skip
