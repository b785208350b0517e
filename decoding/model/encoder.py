"""Encoder models (BERT family) that embed or score text instead of generating it.

A BERT encoder is post-norm: embeddings (token + absolute position + token type) → LayerNorm, then per
layer self-attention over the whole input (bidirectional) with biases → + residual → LayerNorm → GELU
feed-forward with biases → + residual → LayerNorm. What it is for comes from the directory:

- an *embedder* (sentence-transformers: `modules.json` names Transformer, Pooling and maybe Normalize;
  `1_Pooling/config.json` the pooling: the mean of every token's last hidden state, the [CLS] token's
  or the last token's), whose output is one vector per input, L2-normalised where Normalize is listed;
- a *cross-encoder* (`BertForSequenceClassification`): the query and a document as one pair input
  (token types 0 and 1), the [CLS] state through the pooler (dense + tanh) and the classifier, one
  score per label (a sigmoid on a single label, as sentence-transformers' CrossEncoder applies).

Weights map straight out of `model.safetensors` (transformers' names, with or without the `bert.` prefix
a task head adds); WordPiece tokenization is `tokenizers` reading `tokenizer.json` with the padding and
truncation it may carry turned off (inputs are packed, never padded; over-long ones are refused or cut
by the caller).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelLoadError
from .safetensors_loader import map_safetensors
from .weights import WeightMatrix

ENCODER_ARCHITECTURES = ("bert",)
POOLINGS = ("mean", "cls", "last")
TASKS = ("embed", "classify")


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """A model as the embedding engine and routes serve it: a BERT's shape and head, or (DecoderEmbedder)
    a generation model's sizes with the pooling it is served with."""

    n_layers: int
    dim: int
    hidden_dim: int  # feed-forward width
    n_heads: int
    vocab_size: int
    max_positions: int  # absolute position embeddings
    max_context: int  # tokens an input may have (sentence-transformers' max_seq_length, else max_positions)
    n_token_types: int
    norm_eps: float
    task: str  # "embed" (pooled vectors) or "classify" (a cross-encoder's scores)
    pooling: str = "mean"  # embed: one of POOLINGS
    normalize: bool = False  # embed: L2-normalise the pooled vector
    n_labels: int = 0  # classify: scores per input
    sigmoid: bool = False  # classify: scores through a sigmoid
    matryoshka_dims: tuple[int, ...] = ()  # output sizes the model was trained to be cut to (empty: none)
    architecture: str = "bert"
    name: str = ""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"{self.n_heads} heads do not divide width {self.dim}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not 0 < self.max_context <= self.max_positions:
            raise ValueError(f"a context of {self.max_context} with {self.max_positions} position embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def output_dim(self) -> int:
        return self.dim if self.task == "embed" else self.n_labels


@dataclass(frozen=True, slots=True)
class EncoderLayerWeights:
    wq: WeightMatrix  # (dim, dim)
    wk: WeightMatrix
    wv: WeightMatrix
    wo: WeightMatrix
    w_up: WeightMatrix  # (hidden_dim, dim)
    w_down: WeightMatrix  # (dim, hidden_dim)
    biases: np.ndarray  # (5, dim) float32: Q, K, V, output and down projections' biases
    up_bias: np.ndarray  # (hidden_dim,) float32
    norms: np.ndarray  # (4, dim) float32: attention LayerNorm weight, bias; feed-forward LayerNorm weight, bias

    def matrices(self) -> tuple[WeightMatrix, ...]:
        return (self.wq, self.wk, self.wv, self.wo, self.w_up, self.w_down)


@dataclass(frozen=True, slots=True)
class EncoderWeights:
    token_embedding: WeightMatrix  # (vocab, dim)
    position_embedding: np.ndarray  # (max_positions, dim) float32
    type_embedding: np.ndarray  # (n_token_types, dim) float32
    embedding_norm: np.ndarray  # (2, dim) float32: LayerNorm weight, bias
    layers: tuple[EncoderLayerWeights, ...]
    pooler: np.ndarray | None = None  # classify: (dim, dim) float32 dense before tanh
    pooler_bias: np.ndarray | None = None  # (dim,)
    classifier: np.ndarray | None = None  # classify: (n_labels, dim) float32
    classifier_bias: np.ndarray | None = None  # (n_labels,)

    @property
    def nbytes(self) -> int:
        matrices = sum(m.nbytes for layer in self.layers for m in layer.matrices())
        return matrices + self.token_embedding.nbytes + self.position_embedding.nbytes


class EncoderTokenizer:
    """WordPiece (or any `tokenizers` model) with the special tokens the model's post-processor adds:
    `[CLS] text [SEP]`, and `[CLS] a [SEP] b [SEP]` with token types 0 and 1 for a pair."""

    def __init__(self, backend: HFTokenizer) -> None:
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: Path) -> EncoderTokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exceptions on bad files
            raise ModelLoadError(f"{path}: not a tokenizer.json tokenizers can read ({exc})") from None

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, token types) of one text, special tokens included."""
        encoding = self._backend.encode(text)
        return encoding.ids, encoding.type_ids

    def encode_pair(self, first: str, second: str, max_tokens: int | None = None) -> tuple[list[int], list[int]]:
        """[CLS] first [SEP] second [SEP] with token types 0 and 1 (the caller cuts to `max_tokens`)."""
        encoding = self._backend.encode(first, second)
        return encoding.ids, encoding.type_ids

    def encode_batch(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        return [(e.ids, e.type_ids) for e in self._backend.encode_batch(texts)]

    def special_tokens_mask(self, text: str) -> list[int]:
        """1 for each special token the post-processor adds around `text`'s tokens, 0 for the text's."""
        return self._backend.encode(text).special_tokens_mask

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass(eq=False)
class EncoderModel:
    config: EncoderConfig
    weights: EncoderWeights
    tokenizer: EncoderTokenizer
    path: Path
    name: str


def is_encoder_directory(path: Path) -> bool:
    """Whether a Hugging Face directory holds an encoder treadle serves as one (config.json's model_type)."""
    try:
        return _read_json(path / "config.json").get("model_type") in ENCODER_ARCHITECTURES
    except ModelLoadError:
        return False


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc})") from None


def _sentence_transformers_modules(path: Path) -> tuple[str, bool, int]:
    """(pooling, normalize, max_seq_length) from a sentence-transformers directory's module list; a
    directory without one pools by the mean, unnormalised (transformers' BertModel as it is)."""
    pooling, normalize, max_length = "mean", False, 0
    modules_file = path / "modules.json"
    if (path / "sentence_bert_config.json").is_file():
        max_length = int(_read_json(path / "sentence_bert_config.json").get("max_seq_length") or 0)
    if not modules_file.is_file():
        return pooling, normalize, max_length
    for module in _read_json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _pooling_mode(_read_json(path / module.get("path", "") / "config.json"))
        else:
            raise ModelLoadError(f"{path}: the sentence-transformers module {kind!r} is not supported "
                                 "(treadle runs Transformer, Pooling and Normalize)")
    return pooling, normalize, max_length


def _pooling_mode(config: dict[str, Any]) -> str:
    modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
    chosen = [mode for key, mode in modes.items() if config.get(key)]
    unsupported = [key for key, value in config.items()
                   if key.startswith("pooling_mode_") and value and key not in modes]  # fmt: skip
    if unsupported or len(chosen) != 1:
        raise ModelLoadError(f"pooling {sorted(k for k, v in config.items() if k.startswith('pooling_mode_') and v)} "
                             "is not supported: treadle pools by one of the mean, the CLS token or the last token")
    return chosen[0]


def read_encoder_config(path: Path) -> EncoderConfig:
    cfg = _read_json(path / "config.json")
    if cfg.get("model_type") != "bert":
        raise ModelLoadError(f"{path}: model_type {cfg.get('model_type')!r} is not an encoder treadle runs (bert)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{path}: position_embedding_type {cfg['position_embedding_type']!r} is not supported")
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (bert's gelu is)")
    architectures = cfg.get("architectures") or ["BertModel"]
    classify = "BertForSequenceClassification" in architectures
    pooling, normalize, max_length = _sentence_transformers_modules(path)
    max_positions = int(cfg["max_position_embeddings"])
    n_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2)) if classify else 0
    activation = (cfg.get("sentence_transformers") or {}).get("activation_fn", "")
    sigmoid = classify and (activation.endswith("Sigmoid") or (not activation and n_labels == 1))
    matryoshka = cfg.get("matryoshka_dimensions") or ()
    return EncoderConfig(
        n_layers=int(cfg["num_hidden_layers"]), dim=int(cfg["hidden_size"]),
        hidden_dim=int(cfg["intermediate_size"]), n_heads=int(cfg["num_attention_heads"]),
        vocab_size=int(cfg["vocab_size"]), max_positions=max_positions,
        max_context=min(max_length or max_positions, max_positions), n_token_types=int(cfg.get("type_vocab_size", 2)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), task="classify" if classify else "embed",
        pooling="cls" if classify else pooling, normalize=normalize and not classify, n_labels=n_labels,
        sigmoid=sigmoid, matryoshka_dims=tuple(int(d) for d in matryoshka), name=path.name,
    )  # fmt: skip


def load_encoder_directory(path: Path, name: str | None = None) -> EncoderModel:
    """A BERT directory (sentence-transformers embedder, or a BertForSequenceClassification cross-encoder)."""
    cfg = read_encoder_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors weights")
    tensors: dict[str, tuple[np.ndarray, Any]] = {}
    for file in files:
        tensors.update(map_safetensors(file))
    prefix = "bert." if any(key.startswith("bert.") for key in tensors) else ""

    def array(key: str, shape: tuple[int, ...]) -> np.ndarray:
        name_in_file = key if key.startswith("classifier.") else prefix + key
        if name_in_file not in tensors:
            raise ModelLoadError(f"{path}: tensor {name_in_file} is missing")
        data, _ = tensors[name_in_file]
        if tuple(data.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name_in_file} has shape {tuple(data.shape)}, expected {shape}")
        return data.astype(np.float32) if data.dtype != np.uint16 else _bf16(data)

    def matrix(key: str, rows: int, cols: int) -> WeightMatrix:
        name_in_file = prefix + key
        if name_in_file not in tensors:
            raise ModelLoadError(f"{path}: tensor {name_in_file} is missing")
        data, qtype = tensors[name_in_file]
        if tuple(data.shape) != (rows, cols):
            raise ModelLoadError(f"{path}: tensor {name_in_file} has shape {tuple(data.shape)}, "
                                 f"expected {(rows, cols)}")
        return WeightMatrix(qtype, rows, cols, data)

    d, h = cfg.dim, cfg.hidden_dim
    layers = []
    for i in range(cfg.n_layers):
        p = f"encoder.layer.{i}."
        layers.append(EncoderLayerWeights(
            wq=matrix(p + "attention.self.query.weight", d, d), wk=matrix(p + "attention.self.key.weight", d, d),
            wv=matrix(p + "attention.self.value.weight", d, d), wo=matrix(p + "attention.output.dense.weight", d, d),
            w_up=matrix(p + "intermediate.dense.weight", h, d), w_down=matrix(p + "output.dense.weight", d, h),
            biases=np.stack([array(p + k, (d,)) for k in ("attention.self.query.bias", "attention.self.key.bias",
                             "attention.self.value.bias", "attention.output.dense.bias", "output.dense.bias")]),
            up_bias=array(p + "intermediate.dense.bias", (h,)),
            norms=np.stack([array(p + k, (d,)) for k in ("attention.output.LayerNorm.weight",
                            "attention.output.LayerNorm.bias", "output.LayerNorm.weight", "output.LayerNorm.bias")]),
        ))  # fmt: skip
    head: dict[str, np.ndarray] = {}
    if cfg.task == "classify":
        head = dict(pooler=array("pooler.dense.weight", (d, d)), pooler_bias=array("pooler.dense.bias", (d,)),
                    classifier=array("classifier.weight", (cfg.n_labels, d)),
                    classifier_bias=array("classifier.bias", (cfg.n_labels,)))  # fmt: skip
    weights = EncoderWeights(
        token_embedding=matrix("embeddings.word_embeddings.weight", cfg.vocab_size, d),
        position_embedding=array("embeddings.position_embeddings.weight", (cfg.max_positions, d)),
        type_embedding=array("embeddings.token_type_embeddings.weight", (cfg.n_token_types, d)),
        embedding_norm=np.stack([array("embeddings.LayerNorm.weight", (d,)), array("embeddings.LayerNorm.bias", (d,))]),
        layers=tuple(layers), **head,
    )  # fmt: skip
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    tokenizer = EncoderTokenizer.from_file(tokenizer_file)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {cfg.vocab_size}")
    return EncoderModel(cfg, weights, tokenizer, path, name or path.name)


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling, normalize) of a sentence-transformers directory's modules, None if it has none."""
    if not (path / "modules.json").is_file():
        return None
    pooling, normalize, _ = _sentence_transformers_modules(path)
    return pooling, normalize
