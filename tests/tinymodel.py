"""Small random llama models written to disk as GGUF and as Hugging Face directories, for fast tests.

The same random float weights can be written both ways, so the two loaders can be checked against
each other: the GGUF gets query/key rows permuted into ggml's rotary order exactly as llama.cpp's
converter does, the Hugging Face directory keeps them in rotate-half order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from bench.kernels import store_as
from decoding.model.quant import QType, quantize

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    n_layers: int = 2
    dim: int = 64
    hidden_dim: int = 96
    n_heads: int = 4
    n_kv_heads: int = 2
    max_context: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Specials, the 256 byte-level symbols, and a few merges: a working byte-level BPE."""
    alphabet = sorted(ByteLevel.alphabet())
    merge_pairs = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n")]
    tokens = SPECIAL_TOKENS + alphabet + ["".join(p) for p in merge_pairs]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, [f"{a} {b}" for a, b in merge_pairs], types


def random_weights(shape: TinyShape, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Hugging Face names → float32 arrays (q/k in rotate-half order)."""
    rng = np.random.default_rng(seed)
    d, h, hd = shape.dim, shape.hidden_dim, shape.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab_size, d), "model.norm.weight": 1 + 0.1 * rng.standard_normal(d)}
    for i in range(shape.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        w[p + "self_attn.q_proj.weight"] = mat(shape.n_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(shape.n_kv_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(shape.n_kv_heads * hd, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, shape.n_heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(h, d)
        w[p + "mlp.up_proj.weight"] = mat(h, d)
        w[p + "mlp.down_proj.weight"] = mat(d, h)
    return {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}


def permute_for_ggml_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: rotate-half Q/K rows → adjacent pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(path: Path, shape: TinyShape = TinyShape(), qtype: QType = QType.F32, seed: int = 0,
               architecture: str = "llama", embedding_qtype: QType | None = None) -> Path:
    tokens, merges, types = tiny_vocab()
    weights = random_weights(shape, len(tokens), seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(shape.n_layers)
    writer.add_context_length(shape.max_context)
    writer.add_embedding_length(shape.dim)
    writer.add_feed_forward_length(shape.hidden_dim)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed + 1)

    def add(name: str, array: np.ndarray, tensor_qtype: QType) -> None:
        if array.ndim == 1:
            writer.add_tensor(name, array.astype(np.float32))
            return
        raw = gguf.GGMLQuantizationType(int(tensor_qtype))
        stored = store_as(array, tensor_qtype, rng)  # K types: random super-blocks (nobody quantizes to them)
        writer.add_tensor(name, stored, raw_dtype=None if tensor_qtype == QType.F32 else raw)

    add("token_embd.weight", weights["model.embed_tokens.weight"], embedding_qtype or qtype)
    add("output_norm.weight", weights["model.norm.weight"], QType.F32)
    for i in range(shape.n_layers):
        for hf_name, gg_name in _GGUF_NAMES.items():
            array = weights[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                array = permute_for_ggml_rope(array, shape.n_heads)
            elif hf_name == "self_attn.k_proj":
                array = permute_for_ggml_rope(array, shape.n_kv_heads)
            add(f"blk.{i}.{gg_name}.weight", array, QType.F32 if array.ndim == 1 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return quantize(a.reshape(1, -1) if a.ndim == 1 else a, QType.BF16).reshape(a.shape)


def write_hf_directory(directory: Path, shape: TinyShape = TinyShape(), seed: int = 0, dtype: str = "F32") -> Path:
    """config.json, model.safetensors (F32, F16 or BF16) and tokenizer.json for the same tiny model."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens, merges, _ = tiny_vocab()
    weights = random_weights(shape, len(tokens), seed)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.dim,
        "intermediate_size": shape.hidden_dim, "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads, "num_key_value_heads": shape.n_kv_heads,
        "max_position_embeddings": shape.max_context, "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_eps, "vocab_size": len(tokens), "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name, array in weights.items():
        if dtype == "BF16":
            blob = _bf16_bits(array).tobytes()
        elif dtype == "F16":
            blob = array.astype(np.float16).tobytes()
        else:
            blob = array.astype(np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header).encode()
    with (directory / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return directory
