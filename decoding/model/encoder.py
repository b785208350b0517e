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
from .model import Model
from .safetensors_loader import map_safetensors
from .tokenizer import Tokenizer
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
    from .gguf_loader import _field, _reader, _require, _to_matrix, _to_vector

    reader = _reader(path)
    arch = str(_require(reader, "general.architecture"))
    if arch != "bert":
        raise ModelLoadError(f"{path.name}: architecture {arch!r} is not an encoder treadle runs (bert)")
    if _field(reader, "bert.attention.causal", False):
        raise ModelLoadError(f"{path.name}: a causal BERT is not supported")
    tensors = {t.name: t for t in reader.tensors}
    pooling_type = int(_field(reader, "bert.pooling_type", 1) or 0)
    classify = pooling_type == 4
    if not classify and pooling_type not in _GGUF_POOLING:
        raise ModelLoadError(f"{path.name}: pooling type {pooling_type} is not supported (mean, CLS, last or rank)")
    dim = int(_require(reader, "bert.embedding_length"))
    n_layers = int(_require(reader, "bert.block_count"))
    token_embedding = tensors["token_embd.weight"]
    vocab_size = int(token_embedding.shape[1])
    n_labels = int(tensors["cls.output.weight"].shape[1]) if classify and "cls.output.weight" in tensors else 0
    context = int(_require(reader, "bert.context_length"))
    cfg = EncoderConfig(
        n_layers=n_layers, dim=dim, hidden_dim=int(_require(reader, "bert.feed_forward_length")),
        n_heads=int(_require(reader, "bert.attention.head_count")), vocab_size=vocab_size,
        max_positions=int(tensors["position_embd.weight"].shape[1]), max_context=context,
        n_token_types=int(_field(reader, "tokenizer.ggml.token_type_count", 2) or 2),
        norm_eps=float(_require(reader, "bert.attention.layer_norm_epsilon")),
        task="classify" if classify else "embed", pooling="cls" if classify else _GGUF_POOLING[pooling_type],
        normalize=not classify, n_labels=n_labels, sigmoid=classify and n_labels == 1, name=path.stem,
    )  # fmt: skip

    def tensor(key: str) -> Any:
        if key not in tensors:
            raise ModelLoadError(f"{path.name}: tensor {key} is missing")
        return tensors[key]

    def dense(key: str, rows: int, cols: int) -> np.ndarray:
        return np.ascontiguousarray(_to_matrix(tensor(key), (rows, cols)).dequantize(), dtype=np.float32)

    def vector(key: str, length: int) -> np.ndarray:
        return _to_vector(tensor(key), length)

    d, h = cfg.dim, cfg.hidden_dim
    layers = []
    for i in range(n_layers):
        p = f"blk.{i}."
        layers.append(EncoderLayerWeights(
            wq=_to_matrix(tensor(p + "attn_q.weight"), (d, d)), wk=_to_matrix(tensor(p + "attn_k.weight"), (d, d)),
            wv=_to_matrix(tensor(p + "attn_v.weight"), (d, d)),
            wo=_to_matrix(tensor(p + "attn_output.weight"), (d, d)),
            w_up=_to_matrix(tensor(p + "ffn_up.weight"), (h, d)),
            w_down=_to_matrix(tensor(p + "ffn_down.weight"), (d, h)),
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
        token_embedding=_to_matrix(token_embedding, (vocab_size, d)),
        position_embedding=dense("position_embd.weight", cfg.max_positions, d),
        type_embedding=dense("token_types.weight", int(types_tensor.shape[1]), d),
        embedding_norm=np.stack([vector("token_embd_norm.weight", d), vector("token_embd_norm.bias", d)]),
        layers=tuple(layers), **head,
    )  # fmt: skip
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    token_types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
    lowercase = bool(_field(reader, "tokenizer.ggml.normalizer.lowercase", True))
    return EncoderModel(cfg, weights, gguf_tokenizer(tokens, token_types, lowercase), path, name or path.stem)


def is_encoder_gguf(path: Path) -> bool:
    """Whether a GGUF file's architecture is an encoder's (read from its header alone)."""
    from .gguf_loader import gguf_architecture

    try:
        return gguf_architecture(path) in ENCODER_ARCHITECTURES
    except OSError:  # an unreadable file is for the decoder loader to refuse with its reason
        return False


class DecoderEmbeddingTokenizer:
    """A generation model's tokenizer as an embedder uses it: the tokenizer's own special tokens (BOS where
    the model adds one), and EOS at the end where the model asks for it (`add_eos_token`: an embedder
    pooling the last token reads that token's state, as Qwen3-Embedding does). A reranker's tokenizer
    renders a (query, document) pair into its `pair_template` (`{query}`, `{document}`) as one input."""

    def __init__(self, tokenizer: Tokenizer, add_eos: bool, pair_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_ids[0] if add_eos and tokenizer.eos_token_ids else None
        self.vocab_size = tokenizer.vocab_size
        self.pair_template = pair_template

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        # tokenizer.json's own post-processor first (a sentence-transformers directory's: Qwen3-Embedding's
        # appends EOS there), then what a GGUF's flags ask for and the post-processor did not add
        tokenizer = self.tokenizer
        ids = tokenizer.backend.encode(text, add_special_tokens=True).ids
        if tokenizer.add_bos_token and (not ids or ids[0] != tokenizer.bos_token_id):
            ids.insert(0, tokenizer.bos_token_id)
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
        return ids, [0] * len(ids)

    def encode_pair(self, first: str, second: str, max_tokens: int | None = None) -> tuple[list[int], list[int]]:
        """A reranker's input for (query, document): the template rendered with both, special tokens as
        tokens. With `max_tokens`, the document is cut (at a token, from its end) until the input fits:
        the template's tail is what the score is read after, so it is never the part cut."""
        if self.pair_template is None:
            raise ModelLoadError("a decoder embedder scores pairs by the cosine of their embeddings, not as one input")
        ids = self._render(first, second)
        if max_tokens is not None and len(ids) > max_tokens:
            document = self.tokenizer.backend.encode(second, add_special_tokens=False).ids
            keep = len(document) - (len(ids) - max_tokens)
            while keep > 0 and len(ids := self._render(first, self.tokenizer.decode(document[:keep]))) > max_tokens:
                keep -= 1
            if keep <= 0:
                ids = self._render(first, "")
        return ids, [0] * len(ids)

    def _render(self, query: str, document: str) -> list[int]:
        text = self.pair_template.replace("{query}", query).replace("{document}", document)  # type: ignore[union-attr]
        return self.tokenizer.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        return [self.encode(text) for text in texts]

    def special_tokens_mask(self, text: str) -> list[int]:
        plain = self.tokenizer.backend.encode(text, add_special_tokens=False).ids
        ids, _ = self.encode(text)
        head = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), 0)
        return [1] * head + [0] * len(plain) + [1] * (len(ids) - len(plain) - head)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass(eq=False)
class DecoderEmbedder:
    """A generation model served as an embedder (`treadle serve --task embed`, or a file that declares a
    pooling): its layers over each whole input, the final-normed hidden states pooled (the last token's,
    the mean, or the first's) and L2-normalised where the model says so. `config` is the shape the
    embedding engine and routes read, with the decoder's sizes."""

    config: EncoderConfig
    decoder: Model
    tokenizer: DecoderEmbeddingTokenizer
    path: Path
    name: str
    weights: EncoderWeights | None = None  # the decoder's live in `decoder`; no BERT classifier head
    # a reranker (config.task "classify"): the rows of the LM head whose logits score a pair, "yes" then
    # "no" (Qwen3-Reranker's recipe); the score is softmax over the two, p(yes) = sigmoid(yes - no)
    score_rows: np.ndarray | None = None


def decoder_embedder(model: Model, pooling: str, normalize: bool, max_context: int) -> DecoderEmbedder:
    mc = model.config
    cfg = EncoderConfig(
        n_layers=mc.n_layers, dim=mc.dim, hidden_dim=mc.hidden_dim, n_heads=mc.n_heads, vocab_size=mc.vocab_size,
        max_positions=mc.max_context, max_context=min(max_context, mc.max_context), n_token_types=1,
        norm_eps=mc.rms_eps, task="embed", pooling=pooling, normalize=normalize, architecture=mc.architecture,
        name=model.name,
    )  # fmt: skip
    return DecoderEmbedder(cfg, model, DecoderEmbeddingTokenizer(model.tokenizer, mc.add_eos_token), model.path,
                           model.name)


def sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling, normalize) of a sentence-transformers directory's modules, None if it has none."""
    if not (path / "modules.json").is_file():
        return None
    pooling, normalize, _ = _sentence_transformers_modules(path)
    return pooling, normalize
