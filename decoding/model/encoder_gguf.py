"""BERT encoders from GGUF files as llama.cpp's converter writes them: the `bert.*` keys, the pooling
type, the phantom-space WordPiece vocabulary rebuilt for `tokenizers`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from .encoder import (
    ENCODER_ARCHITECTURES,
    EncoderConfig,
    EncoderLayerWeights,
    EncoderModel,
    EncoderTokenizer,
    EncoderWeights,
)
from .errors import ModelLoadError
from .gguf_loader import field_value, gguf_architecture, gguf_reader, required_field, tensor_matrix, tensor_vector

# llama.cpp's pooling_type key: 0 none, 1 mean, 2 CLS, 3 last token, 4 rank (a cross-encoder's head)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def gguf_tokenizer(tokens: list[str], token_types: list[int], lowercase: bool = True) -> EncoderTokenizer:
    """WordPiece from a GGUF vocabulary as llama.cpp's converter writes a BERT's: control tokens as they
    are, word-initial pieces behind U+2581, continuations bare (tokenizer.json's `##` taken off).
    Normalised as llama.cpp's WPM tokenizer does: CJK split, and lower case with accents stripped unless
    the file says its model is cased (`tokenizer.ggml.normalizer.lowercase`)."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    control = 3
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == control:
            piece = token
        elif token.startswith("\u2581"):
            piece = token[1:]
        else:
            piece = "##" + token
        vocab.setdefault(piece, i)
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]") if t not in vocab]
    if missing:
        raise ModelLoadError(f"the GGUF vocabulary lacks {', '.join(missing)}: not a BERT WordPiece vocabulary")
    backend = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    backend.decoder = decoders.WordPiece()
    specials = [token for token, kind in zip(tokens, token_types, strict=True) if kind == control]
    backend.add_special_tokens(specials)
    return EncoderTokenizer(backend)


def load_encoder_gguf(path: Path, name: str | None = None) -> EncoderModel:
    """A BERT GGUF as llama.cpp's converter writes it (`bert.*` keys, `pooling_type`, the phantom-space
    WordPiece vocabulary). Embeddings come out L2-normalised, as llama-server's do by default; a file
    whose pooling is rank (a cross-encoder) needs its pooler and classifier (`cls`, `cls.output`)."""
    reader = gguf_reader(path)
    arch = str(required_field(reader, "general.architecture"))
    if arch != "bert":
        raise ModelLoadError(f"{path.name}: architecture {arch!r} is not an encoder treadle runs (bert)")
    if field_value(reader, "bert.attention.causal", False):
        raise ModelLoadError(f"{path.name}: a causal BERT is not supported")
    tensors = {t.name: t for t in reader.tensors}
    pooling_type = int(field_value(reader, "bert.pooling_type", 1) or 0)
    classify = pooling_type == 4
    if not classify and pooling_type not in _GGUF_POOLING:
        raise ModelLoadError(f"{path.name}: pooling type {pooling_type} is not supported (mean, CLS, last or rank)")
    dim = int(required_field(reader, "bert.embedding_length"))
    n_layers = int(required_field(reader, "bert.block_count"))
    token_embedding = tensors["token_embd.weight"]
    vocab_size = int(token_embedding.shape[1])
    n_labels = int(tensors["cls.output.weight"].shape[1]) if classify and "cls.output.weight" in tensors else 0
    context = int(required_field(reader, "bert.context_length"))
    cfg = EncoderConfig(
        n_layers=n_layers, dim=dim, hidden_dim=int(required_field(reader, "bert.feed_forward_length")),
        n_heads=int(required_field(reader, "bert.attention.head_count")), vocab_size=vocab_size,
        max_positions=int(tensors["position_embd.weight"].shape[1]), max_context=context,
        n_token_types=int(field_value(reader, "tokenizer.ggml.token_type_count", 2) or 2),
        norm_eps=float(required_field(reader, "bert.attention.layer_norm_epsilon")),
        task="classify" if classify else "embed", pooling="cls" if classify else _GGUF_POOLING[pooling_type],
        normalize=not classify, n_labels=n_labels, sigmoid=classify and n_labels == 1, name=path.stem,
    )  # fmt: skip

    def tensor(key: str) -> Any:
        if key not in tensors:
            raise ModelLoadError(f"{path.name}: tensor {key} is missing")
        return tensors[key]

    def dense(key: str, rows: int, cols: int) -> np.ndarray:
        return np.ascontiguousarray(tensor_matrix(tensor(key), (rows, cols)).dequantize(), dtype=np.float32)

    def vector(key: str, length: int) -> np.ndarray:
        return tensor_vector(tensor(key), length)

    d, h = cfg.dim, cfg.hidden_dim
    layers = []
    for i in range(n_layers):
        p = f"blk.{i}."
        layers.append(EncoderLayerWeights(
            wq=tensor_matrix(tensor(p + "attn_q.weight"), (d, d)),
            wk=tensor_matrix(tensor(p + "attn_k.weight"), (d, d)),
            wv=tensor_matrix(tensor(p + "attn_v.weight"), (d, d)),
            wo=tensor_matrix(tensor(p + "attn_output.weight"), (d, d)),
            w_up=tensor_matrix(tensor(p + "ffn_up.weight"), (h, d)),
            w_down=tensor_matrix(tensor(p + "ffn_down.weight"), (d, h)),
            biases=np.stack([vector(p + k, d) for k in ("attn_q.bias", "attn_k.bias", "attn_v.bias",
                                                          "attn_output.bias", "ffn_down.bias")]),
            up_bias=vector(p + "ffn_up.bias", h),
            norms=np.stack([vector(p + k, d) for k in ("attn_output_norm.weight", "attn_output_norm.bias",
                                                         "layer_output_norm.weight", "layer_output_norm.bias")]),
        ))  # fmt: skip
    head: dict[str, np.ndarray] = {}
    if classify:
        if "cls.weight" not in tensors or not n_labels:
            raise ModelLoadError(f"{path.name}: a rank-pooling file needs its pooler (cls) and classifier (cls.output)")
        head = dict(pooler=dense("cls.weight", d, d), pooler_bias=vector("cls.bias", d),
                    classifier=dense("cls.output.weight", n_labels, d),
                    classifier_bias=vector("cls.output.bias", n_labels))  # fmt: skip
    types_tensor = tensor("token_types.weight")
    weights = EncoderWeights(
        token_embedding=tensor_matrix(token_embedding, (vocab_size, d)),
        position_embedding=dense("position_embd.weight", cfg.max_positions, d),
        type_embedding=dense("token_types.weight", int(types_tensor.shape[1]), d),
        embedding_norm=np.stack([vector("token_embd_norm.weight", d), vector("token_embd_norm.bias", d)]),
        layers=tuple(layers), **head,
    )  # fmt: skip
    tokens = list(required_field(reader, "tokenizer.ggml.tokens"))
    token_types = [int(t) for t in field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
    lowercase = bool(field_value(reader, "tokenizer.ggml.normalizer.lowercase", True))
    return EncoderModel(cfg, weights, gguf_tokenizer(tokens, token_types, lowercase), path, name or path.stem)


def is_encoder_gguf(path: Path) -> bool:
    """Whether a GGUF file's architecture is an encoder's (read from its header alone)."""
    try:
        return gguf_architecture(path) in ENCODER_ARCHITECTURES
    except OSError:  # an unreadable file is for the decoder loader to refuse with its reason
        return False
