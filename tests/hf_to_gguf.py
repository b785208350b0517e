"""The tiny Hugging Face models of tests/golden/architectures as GGUF files, written the way llama.cpp's
convert_hf_to_gguf.py writes each architecture: its tensor names and metadata keys, llama's Q/K
rows permuted for adjacent-pair RoPE, llama 3's rope scaling as a `rope_freqs` tensor, Gemma's norm
weights stored as 1 + w, a mixture's experts stacked into one 3-D tensor per projection beside its
router (`ffn_gate_inp`). The same weights then load through treadle's GGUF path and must give the
transformers logits the directory's golden holds."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from decoding.model.quant import QType, quantize
from decoding.model.safetensors_loader import llama3_frequency_factors, map_safetensors
from decoding.model.weights import WeightMatrix
from tests.tinymodel import permute_for_ggml_rope

GGUF_ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                     "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# a mixture's projections: (GGUF name, Qwen3-MoE's expert tensor, Mixtral's)
_EXPERT_NAMES = (("ffn_gate_exps", "gate_proj", "w1"), ("ffn_up_exps", "up_proj", "w3"),
                 ("ffn_down_exps", "down_proj", "w2"))
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GEMMA_NORM_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip


def convert(directory: Path, out: Path, qtype: QType = QType.F32, pooling_type: int = 0,
            rerank_template: str | None = None) -> Path:
    """`qtype`: how the layers' matrices (and experts) are stored, as llama-quantize would store them;
    the embedding, head, norms and routers stay F32. `pooling_type`: llama.cpp's key for an embedding
    model (1 mean, 3 last token, as its converter writes Qwen3-Embedding's), with EOS added to inputs.
    `rerank_template`: a Qwen3-Reranker as llama.cpp's converter writes one: rank pooling, the head's rows
    of "yes" and "no" as `cls.output.weight` (and no `output.weight`), the template as the "rerank" chat
    template."""
    cfg = json.loads((directory / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCHITECTURE[model_type]
    gemma = arch == "gemma3"
    n_heads, n_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base((rope["full_attention"] if gemma else rope)["rope_theta"])
    if rerank_template is not None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
    elif pooling_type:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
        writer.add_add_eos_token(True)
    if cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if model_type == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if gemma:
        pattern = cfg["layer_types"].index("full_attention") + 1
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", pattern)
        if cfg["query_pre_attn_scalar"] != head_dim:
            writer.add_float32(f"{arch}.attention.scale", cfg["query_pre_attn_scalar"] ** -0.5)

    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()} | {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [by_id[i] for i in range(len(by_id))]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    user_defined = {t["content"] for t in tok["added_tokens"] if not t["special"]}
    n_real = len(tokens)
    tokens += [f"[PAD{i}]" for i in range(n_real, cfg["vocab_size"])]  # the converter pads to the model's rows
    tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 4 if t in user_defined else 1 if i < n_real else 5
                            for i, t in enumerate(tokens)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token")))
    if rerank_template is not None:
        writer.add_chat_template([{"name": "rerank", "template": rerank_template}])
    elif tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])
    assert HFTokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size() == n_real

    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(map_safetensors(f))

    def dense(name: str) -> np.ndarray:
        data, qtype = tensors[name]
        shape = data.shape if data.ndim == 2 else (1, data.shape[0])
        return WeightMatrix(qtype, *shape, data.reshape(shape)).dequantize().reshape(data.shape)

    def add(name: str, array: np.ndarray, stored: QType = QType.F32) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if stored == QType.F32:
            writer.add_tensor(name, array)
            return
        blocks = quantize(array.reshape(-1, array.shape[-1]), stored)
        writer.add_tensor(name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(int(stored)))

    def norm(name: str) -> np.ndarray:
        return dense(name) + np.float32(1.0) if gemma else dense(name)

    add("token_embd.weight", dense("model.embed_tokens.weight"))
    add("output_norm.weight", norm("model.norm.weight"))
    untied = "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings")
    if rerank_template is not None:
        head = dense("lm_head.weight" if untied else "model.embed_tokens.weight")
        add("cls.output.weight", np.stack([head[tokens.index(w)] for w in ("yes", "no")]))
    elif untied:
        add("output.weight", dense("lm_head.weight"))
    if rope.get("rope_type") == "llama3":
        add("rope_freqs.weight", np.array(llama3_frequency_factors(rope, head_dim), dtype=np.float32))
    layer_names = dict(_LAYER_NAMES, **(_GEMMA_NORM_NAMES if gemma else {"post_attention_layernorm": "ffn_norm"}))
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in layer_names.items():
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.{hf}.{kind}"
                if name not in tensors:
                    continue
                array = norm(name) if hf.endswith("norm") else dense(name)
                if arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                    array = permute_for_ggml_rope(array, n_heads if hf == "self_attn.q_proj" else n_kv_heads)
                add(f"blk.{i}.{gg}.{kind}", array, qtype if array.ndim == 2 else QType.F32)
        if n_experts:
            block = f"model.layers.{i}." + ("block_sparse_moe." if model_type == "mixtral" else "mlp.")
            add(f"blk.{i}.ffn_gate_inp.weight", dense(block + "gate.weight"))
            for gguf_name, *hf_names in _EXPERT_NAMES:
                name = hf_names[model_type == "mixtral"]
                add(f"blk.{i}.{gguf_name}.weight",
                    np.stack([dense(f"{block}experts.{e}.{name}.weight") for e in range(n_experts)]), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


_BERT_LAYER_NAMES = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}  # fmt: skip
_BERT_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")
_POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}


def convert_bert(directory: Path, out: Path, qtype: QType = QType.F32) -> Path:
    """A BERT directory (sentence-transformers embedder, or BertForSequenceClassification) as llama.cpp's
    converter writes it: `bert.*` keys, pooling_type (rank for a classifier, its pooler as `cls` and its
    classifier as `cls.output`), the WordPiece vocabulary in phantom-space spelling (continuations lose
    their `##`, other non-control tokens gain U+2581). `qtype`: the layers' matrices, as llama-quantize
    would store them; embeddings, norms, biases and the head stay F32."""
    from decoding.model.encoder import read_encoder_config

    cfg = json.loads((directory / "config.json").read_text())
    encoder = read_encoder_config(directory)
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_eps(cfg.get("layer_norm_eps", 1e-12))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(4 if encoder.task == "classify" else _POOLING_TYPES[encoder.pooling]))
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    specials = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    types = [3 if t in specials else 1 for t in tokens]
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t if kind == 3 else t[2:] if t.startswith("##") else "\u2581" + t
                           for t, kind in zip(tokens, types, strict=True)])  # fmt: skip
    writer.add_token_types(types)
    writer.add_token_type_count(cfg.get("type_vocab_size", 2))
    for kind in ("unk", "cls", "sep", "pad", "mask"):
        if f"[{kind.upper()}]" in vocab:
            key = f"tokenizer.ggml.{kind if kind != 'unk' else 'unknown'}_token_id"
            writer.add_uint32(key, vocab[f"[{kind.upper()}]"])

    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(map_safetensors(f))
    prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""

    def add(name: str, key: str, stored: QType = QType.F32) -> None:
        array = np.asarray(tensors[key][0], dtype=np.float32)
        if stored == QType.F32 or array.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(array))
            return
        blocks = quantize(array, stored)
        writer.add_tensor(name, blocks.reshape(array.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType(int(stored)))

    for name, key in (("token_embd", "embeddings.word_embeddings"), ("token_types", "embeddings.token_type_embeddings"),
                      ("position_embd", "embeddings.position_embeddings")):
        add(f"{name}.weight", f"{prefix}{key}.weight")
    add("token_embd_norm.weight", f"{prefix}embeddings.LayerNorm.weight")
    add("token_embd_norm.bias", f"{prefix}embeddings.LayerNorm.bias")
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, name in _BERT_LAYER_NAMES.items():
            key = f"{prefix}encoder.layer.{i}.{hf_name}"
            add(f"blk.{i}.{name}.weight", f"{key}.weight", qtype if name in _BERT_MATRICES else QType.F32)
            add(f"blk.{i}.{name}.bias", f"{key}.bias")
    if encoder.task == "classify":
        add("cls.weight", f"{prefix}pooler.dense.weight")
        add("cls.bias", f"{prefix}pooler.dense.bias")
        add("cls.output.weight", "classifier.weight")
        add("cls.output.bias", "classifier.bias")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
