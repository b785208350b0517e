"""`treadle bench synth`: files with real models' shapes and llama.cpp's type mix, loadable by treadle.

Only the tiny shape is written here; the real shapes are checked through their plans (the parameter
counts are those the models' own cards state, the types those llama.cpp's quantizer picks).
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest

from bench.synth import SHAPES, llama3_rope_factors, tensor_plan, write_model
from decoding import load_model
from decoding.kernels.reference import forward_logits
from decoding.model.quant import QType, dequantize

# parameters of the real models (their Hugging Face cards / safetensors headers)
REAL_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-3b": 3_212_749_824,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
}


@pytest.mark.parametrize("name", sorted(REAL_PARAMETERS))
def test_each_shape_has_its_real_models_parameter_count(name):
    plans = tensor_plan(SHAPES[name], "Q4_K_M")
    assert sum(int(np.prod(p.shape)) for p in plans if p.name != "rope_freqs.weight") == REAL_PARAMETERS[name]


def test_q4_k_m_gives_more_bits_to_llama_cpps_layers_and_a_q6_k_head():
    """Qwen2.5-7B (28 layers, untied): attn_v and ffn_down are Q6_K on layers i < 3, i >= 24 and
    (i - 3) % 3 == 2, everything else Q4_K but the head."""
    types = {p.name: p.qtype for p in tensor_plan(SHAPES["qwen2.5-7b"], "Q4_K_M")}
    more_bits = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}
    for i in range(28):
        expected = QType.Q6_K if i in more_bits else QType.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == expected, i
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == QType.Q4_K
    assert types["output.weight"] == QType.Q6_K and types["token_embd.weight"] == QType.Q4_K
    tied = {p.name: p.qtype for p in tensor_plan(SHAPES["qwen2.5-1.5b"], "Q4_K_M")}
    assert "output.weight" not in tied and tied["token_embd.weight"] == QType.Q6_K


def test_rows_that_do_not_split_into_super_blocks_fall_back_as_llama_cpp_does():
    types = {p.name: p.qtype for p in tensor_plan(SHAPES["qwen2.5-0.5b"], "Q4_K_M")}  # dim 896 = 3.5 × 256
    assert types["blk.4.attn_q.weight"] == QType.Q5_0 and types["blk.0.attn_v.weight"] == QType.Q8_0
    assert types["blk.4.ffn_down.weight"] == QType.Q4_K  # 4864 columns = 19 × 256
    assert types["token_embd.weight"] == QType.Q8_0


@pytest.mark.parametrize(
    ("quant", "matrix_type", "head_type"),
    [("Q8_0", QType.Q8_0, QType.Q8_0), ("Q4_0", QType.Q4_0, QType.Q6_K)],
)
def test_legacy_file_types(quant, matrix_type, head_type):
    types = {p.name: p.qtype for p in tensor_plan(SHAPES["llama-3.1-8b"], quant)}
    assert types["blk.0.attn_v.weight"] == types["blk.31.ffn_down.weight"] == matrix_type
    assert types["output.weight"] == head_type and types["token_embd.weight"] == matrix_type


def test_llama_3_rope_factors_leave_high_frequencies_and_divide_low_ones_by_8():
    factors = llama3_rope_factors(128, 500_000.0)
    assert factors.shape == (64,) and factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, default_model):
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_model("tiny", path, tokenizer=default_model.path)
    return path


def test_the_tiny_shape_loads_with_its_types_and_a_real_tokenizer(tiny_file, default_model):
    model = load_model(tiny_file)
    cfg, shape = model.config, SHAPES["tiny"]
    assert (cfg.architecture, cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.n_heads, cfg.n_kv_heads) == (
        "qwen2",
        shape.n_layers,
        shape.dim,
        shape.hidden_dim,
        shape.n_heads,
        shape.n_kv_heads,
    )
    assert cfg.vocab_size == shape.vocab_size and cfg.qkv_bias and cfg.tied_embeddings
    text = "The loom hums."
    assert model.tokenizer.encode(text) == default_model.tokenizer.encode(text)
    assert model.weights.layers[1].wv.qtype == QType.Q6_K and model.weights.layers[0].wq.qtype == QType.Q4_K
    logits = forward_logits(model, model.tokenizer.encode(text))
    assert np.all(np.isfinite(logits))


def test_random_weights_spread_like_one_over_the_root_of_the_row(tiny_file):
    reader = gguf.GGUFReader(tiny_file)
    for tensor in reader.tensors:
        if tensor.name.endswith("ffn_down.weight") or tensor.name.endswith("attn_q.weight"):
            cols = int(tensor.shape[0])
            weights = dequantize(
                np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1),
                QType(int(tensor.tensor_type)),
                cols,
            )
            assert 0.5 < weights.std() * cols**0.5 < 2.0, tensor.name
            assert np.all(np.isfinite(weights))


def test_a_vocabulary_larger_than_the_tokenizers_is_padded_with_unused_tokens(tmp_path, default_model):
    path = tmp_path / "padded.gguf"
    write_model(replace(SHAPES["tiny"], vocab_size=49152 + 64), path, tokenizer=default_model.path)
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == 49152 + 64 and tokens[-1] == "[PAD49215]"
    assert types[-1] == gguf.TokenType.UNUSED
    assert load_model(path).config.vocab_size == 49152 + 64
