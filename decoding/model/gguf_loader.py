"""Load a GGUF file of a supported architecture: hyperparameters, tokenizer data and memory-mapped weights.

Tensors are views into the file's memory map (GGUFReader maps it read-only): nothing is copied at start,
and pages are read from disk as the kernels first touch them. Types the kernels do not run natively
are dequantized to float32 once, with a logged notice.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .errors import ModelLoadError
from .quant import BLOCK_SHAPES, QType
from .weights import LayerWeights, ModelWeights, WeightMatrix

log = logging.getLogger(__name__)

# as GGUF names them: mistral and Mixtral are "llama" (Mixtral with expert tensors)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")


@dataclass(frozen=True, slots=True)
class GGUFTokenizerData:
    """What `tokenizer.ggml.*` metadata says; turned into a `tokenizers.Tokenizer` by decoding.model.tokenizer."""

    model: str  # "gpt2" = byte-level BPE; "llama" = a SentencePiece vocabulary with scores
    pre: str  # pre-tokenizer name, e.g. "smollm", "llama-bpe", "default"
    tokens: list[str]
    token_types: list[int]  # ggml token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges: list[str]  # "left right"
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    scores: list[float] = field(default_factory=list)  # SentencePiece: each piece's score (merge priority)
    unknown_token_id: int | None = None
    add_space_prefix: bool = False  # SentencePiece: a space before the text and after each special token


# GGUF value types by their code, with the fixed size of a scalar one (8 STRING and 9 ARRAY vary)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` of a GGUF file, read from the start of its header without parsing the rest
    (a full parse of a 150k-token vocabulary takes seconds); None where the file is not a little-endian
    GGUF of version 2 or later, or lacks the key."""
    with open(path, "rb") as file:
        def read_bytes(size: int) -> bytes:
            data = file.read(size)
            if len(data) != size:
                raise EOFError
            return data

        def read(fmt: str) -> Any:
            return struct.unpack(fmt, read_bytes(struct.calcsize(fmt)))[0]

        def skip_value(kind: int) -> None:
            if kind in _SCALAR_SIZES:
                file.seek(_SCALAR_SIZES[kind], os.SEEK_CUR)
            elif kind == _STRING:
                file.seek(read("<Q"), os.SEEK_CUR)
            elif kind == _ARRAY:
                element, count = read("<I"), read("<Q")
                if element in _SCALAR_SIZES:
                    file.seek(_SCALAR_SIZES[element] * count, os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip_value(element)
            else:
                raise ValueError(f"unknown GGUF value type {kind}")

        try:
            if read_bytes(4) != b"GGUF" or read("<I") < 2:
                return None
            read("<Q")  # tensor count
            for _ in range(read("<Q")):
                key = read_bytes(read("<Q"))
                kind = read("<I")
                if key == b"general.architecture" and kind == _STRING:
                    return read_bytes(read("<Q")).decode("utf-8", errors="replace")
                skip_value(kind)
        except (EOFError, ValueError, struct.error):
            return None
    return None


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def required_field(reader: Any, key: str) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks '{key}'")
    return value


# llama.cpp's pooling_type: 0 none (a generation model), 1 mean, 2 CLS, 3 last token, 4 rank (a reranker's head)
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}

# ggml's llama files have their Q and K rows permuted to pair adjacent dimensions; every other
# architecture keeps Hugging Face's order, rotated as (i, i + head_dim/2) ("NEOX" in llama.cpp).
_ADJACENT_PAIR_ROPE = ("llama",)
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's default: every sixth layer global, the rest sliding
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # not in Gemma 3 GGUF files; llama.cpp hard-codes it too


def _architecture_switches(reader: Any, arch: str, n_layers: int, dim: int, n_heads: int, head_dim: int,
                           tensors: set[str]) -> dict[str, Any]:  # fmt: skip
    """The ModelConfig switches one architecture sets, read from the file where the file says them."""
    switches: dict[str, Any] = {"rope_neox": arch not in _ADJACENT_PAIR_ROPE}
    scaling_type = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        switches["rope_linear_factor"] = float(required_field(reader, f"{arch}.rope.scaling.factor"))
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"rope scaling {scaling_type!r} is not supported (treadle runs linear and llama3)")
    if arch == "qwen2":
        switches["qkv_bias"] = True
    elif arch in ("qwen3", "qwen3moe"):
        switches["qk_norm"] = True
    elif arch == "gemma3":
        window = int(required_field(reader, f"{arch}.attention.sliding_window"))
        pattern = int(field_value(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN))
        switches.update(
            qk_norm=True, post_norms=True, activation="gelu_tanh", embedding_scale=float(np.sqrt(np.float32(dim))),
            # the 27B model scales by dim / n_heads; every other size by head_dim (as llama.cpp does)
            attention_scale=(dim // n_heads if n_layers == 62 else head_dim) ** -0.5,
            sliding_window=window, sliding_layers=tuple(i % pattern < pattern - 1 for i in range(n_layers)),
            rope_theta_local=GEMMA3_LOCAL_ROPE_THETA,
        )  # fmt: skip
    window = field_value(reader, f"{arch}.attention.sliding_window")
    if window and arch != "gemma3":  # a mistral-style window on every layer
        switches["sliding_window"] = int(window)
    scale = field_value(reader, f"{arch}.attention.scale")
    if scale:  # a file that states its query scale (Gemma 3's is otherwise derived above)
        switches["attention_scale"] = float(scale)
    if "rope_freqs.weight" in tensors:  # llama 3.1+ scaling, as per-pair frequency divisors
        switches["rope_freq_factors"] = tuple(float(f) for f in _rope_freq_factors(reader))
    switches.update(_experts(reader, arch, tensors))
    return switches


def _experts(reader: Any, arch: str, tensors: set[str]) -> dict[str, Any]:
    """A mixture of experts' switches (none for a dense file). llama.cpp renormalises the chosen
    experts' weights for both architectures here (its `norm_w` for llama and qwen3moe)."""
    n_experts = int(field_value(reader, f"{arch}.expert_count", 0) or 0)
    if not n_experts:
        if arch == "qwen3moe":
            raise ModelLoadError("a qwen3moe file without qwen3moe.expert_count")
        return {}
    if field_value(reader, f"{arch}.expert_shared_count"):
        raise ModelLoadError("shared experts are not supported (treadle runs qwen3moe and Mixtral-style experts)")
    if "blk.0.ffn_gate_exps.weight" not in tensors:
        raise ModelLoadError("experts stored one tensor each (an old Mixtral conversion) are not supported: "
                             "convert again with llama.cpp's convert_hf_to_gguf.py, which stacks them")
    used = int(required_field(reader, f"{arch}.expert_used_count"))
    switches: dict[str, Any] = {"n_experts": n_experts, "n_experts_used": used}
    width = field_value(reader, f"{arch}.expert_feed_forward_length")
    if width:  # qwen3moe's feed_forward_length is its dense width, unused
        switches["hidden_dim"] = int(width)
    return switches


def _rope_freq_factors(reader: Any) -> np.ndarray:
    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    return np.asarray(tensor.data, dtype=np.float32).reshape(-1)


def _read_config(reader: Any, name: str) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} (treadle runs {', '.join(SUPPORTED_ARCHITECTURES)})")
    n_heads = int(required_field(reader, f"{arch}.attention.head_count"))
    n_layers = int(required_field(reader, f"{arch}.block_count"))
    dim = int(required_field(reader, f"{arch}.embedding_length"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", dim // n_heads))
    if int(field_value(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError("keys and values of different widths are not supported")
    if int(field_value(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError("RoPE over part of a head is not supported")
    tokens = required_field(reader, "tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    switches = _architecture_switches(reader, arch, n_layers, dim, n_heads, head_dim, tensor_names)
    switches.setdefault("hidden_dim", int(required_field(reader, f"{arch}.feed_forward_length")))
    try:
        return ModelConfig(
            architecture=arch,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab_size=int(field_value(reader, f"{arch}.vocab_size", len(tokens))),
            max_context=int(required_field(reader, f"{arch}.context_length")),
            rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tied_embeddings="output.weight" not in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            add_bos_token=bool(field_value(reader, "tokenizer.ggml.add_bos_token", True)),
            add_eos_token=bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)),
            pooling=_POOLING_TYPES.get(int(field_value(reader, f"{arch}.pooling_type", 0) or 0), ""),
            name=str(field_value(reader, "general.name", name)),
            **switches,
        )
    except ValueError as exc:
        raise ModelLoadError(f"inconsistent hyperparameters: {exc}") from None


def _read_tokenizer(reader: Any) -> GGUFTokenizerData:
    model = str(required_field(reader, "tokenizer.ggml.model"))
    return GGUFTokenizerData(
        model=model,
        pre=str(field_value(reader, "tokenizer.ggml.pre", "default")),
        tokens=list(required_field(reader, "tokenizer.ggml.tokens")),
        token_types=[int(t) for t in field_value(reader, "tokenizer.ggml.token_type", [])],
        merges=list(field_value(reader, "tokenizer.ggml.merges", [])),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(field_value(reader, "tokenizer.ggml.add_bos_token", True)),
        chat_template=field_value(reader, "tokenizer.chat_template"),
        scores=[float(s) for s in field_value(reader, "tokenizer.ggml.scores", [])],
        unknown_token_id=field_value(reader, "tokenizer.ggml.unknown_token_id"),
        # llama.cpp's default for SentencePiece vocabularies is to add it; Gemma's files say not to
        add_space_prefix=bool(field_value(reader, "tokenizer.ggml.add_space_prefix", model == "llama")),
    )


def tensor_matrix(tensor: Any, expected_shape: tuple[int, int]) -> WeightMatrix:
    """A GGUF tensor (ggml dims are reversed: ne0 = columns) as a stored-form WeightMatrix."""
    import gguf

    n_cols, n_rows = (int(d) for d in tensor.shape[:2])
    if (n_rows, n_cols) != expected_shape:
        raise ModelLoadError(f"tensor {tensor.name} has shape {(n_rows, n_cols)}, expected {expected_shape}")
    raw_type = int(tensor.tensor_type)
    data = tensor.data
    if raw_type in set(QType):
        return _stored_matrix(data, QType(raw_type), n_rows, n_cols)
    log.warning("%s is stored as %s, which treadle's kernels do not run: dequantized to F32 at load",
                tensor.name, tensor.tensor_type.name)
    dense = gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32).reshape(n_rows, n_cols)
    return WeightMatrix(QType.F32, n_rows, n_cols, dense)


def _to_expert_matrix(tensor: Any, n_experts: int, expected_shape: tuple[int, int]) -> WeightMatrix:
    """A 3-D expert tensor (ggml: ne0 = columns, ne1 = rows, ne2 = experts) as one stacked matrix of
    n_experts · rows rows: a view of the file, the experts back to back as stored."""
    n_cols, n_rows, experts = (int(d) for d in tensor.shape[:3]) if len(tensor.shape) >= 3 else (0, 0, 0)
    if (experts, n_rows, n_cols) != (n_experts, *expected_shape):
        raise ModelLoadError(f"tensor {tensor.name} has shape {tuple(int(d) for d in tensor.shape)[::-1]}, "
                             f"expected {(n_experts, *expected_shape)}")
    raw_type = int(tensor.tensor_type)
    if raw_type not in set(QType):
        raise ModelLoadError(f"{tensor.name} is stored as {tensor.tensor_type.name}, which treadle's kernels do not "
                             "run (experts are kept as stored)")
    return _stored_matrix(tensor.data, QType(raw_type), n_experts * n_rows, n_cols)


def _stored_matrix(data: np.ndarray, qtype: QType, n_rows: int, n_cols: int) -> WeightMatrix:
    """A tensor's bytes as an (n_rows, ...) WeightMatrix of its stored type (a view, no copy)."""
    if qtype in BLOCK_SHAPES:
        data = data.reshape(n_rows, -1)
    elif qtype == QType.BF16:
        data = data.view(np.uint16).reshape(n_rows, n_cols)
    else:
        data = data.reshape(n_rows, n_cols)
    return WeightMatrix(qtype, n_rows, n_cols, data)


def _to_router(tensor: Any, n_experts: int, dim: int) -> np.ndarray:
    """The router's (n_experts, dim) scores as float32 (F32 in llama.cpp's files; any stored type read)."""
    return np.ascontiguousarray(tensor_matrix(tensor, (n_experts, dim)).dequantize(), dtype=np.float32)


def tensor_vector(tensor: Any, length: int) -> np.ndarray:
    if int(tensor.tensor_type) != QType.F32 or tensor.data.size != length:
        raise ModelLoadError(f"tensor {tensor.name} should be F32 of {length} values")
    return np.asarray(tensor.data, dtype=np.float32).reshape(length)


def _read_weights(reader: Any, cfg: ModelConfig) -> ModelWeights:
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> Any:
        if name not in tensors:
            raise ModelLoadError(f"GGUF file lacks tensor '{name}'")
        return tensors[name]

    def optional_vector(name: str, length: int, present: bool) -> np.ndarray | None:
        return tensor_vector(get(name), length) if present else None

    d, q, kv, h, hd = cfg.dim, cfg.q_dim, cfg.kv_dim, cfg.hidden_dim, cfg.head_dim
    e = cfg.n_experts

    def feed_forward(p: str) -> dict[str, Any]:
        if not e:
            return dict(w_gate=tensor_matrix(get(p + "ffn_gate.weight"), (h, d)),
                        w_up=tensor_matrix(get(p + "ffn_up.weight"), (h, d)),
                        w_down=tensor_matrix(get(p + "ffn_down.weight"), (d, h)))  # fmt: skip
        return dict(w_gate=_to_expert_matrix(get(p + "ffn_gate_exps.weight"), e, (h, d)),
                    w_up=_to_expert_matrix(get(p + "ffn_up_exps.weight"), e, (h, d)),
                    w_down=_to_expert_matrix(get(p + "ffn_down_exps.weight"), e, (d, h)),
                    router=_to_router(get(p + "ffn_gate_inp.weight"), e, d))  # fmt: skip

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=tensor_vector(get(p + "attn_norm.weight"), d),
                wq=tensor_matrix(get(p + "attn_q.weight"), (q, d)),
                wk=tensor_matrix(get(p + "attn_k.weight"), (kv, d)),
                wv=tensor_matrix(get(p + "attn_v.weight"), (kv, d)),
                wo=tensor_matrix(get(p + "attn_output.weight"), (d, q)),
                ffn_norm=tensor_vector(get(p + "ffn_norm.weight"), d),
                **feed_forward(p),
                q_bias=optional_vector(p + "attn_q.bias", q, cfg.qkv_bias),
                k_bias=optional_vector(p + "attn_k.bias", kv, cfg.qkv_bias),
                v_bias=optional_vector(p + "attn_v.bias", kv, cfg.qkv_bias),
                q_norm=optional_vector(p + "attn_q_norm.weight", hd, cfg.qk_norm),
                k_norm=optional_vector(p + "attn_k_norm.weight", hd, cfg.qk_norm),
                post_attn_norm=optional_vector(p + "post_attention_norm.weight", d, cfg.post_norms),
                post_ffn_norm=optional_vector(p + "post_ffw_norm.weight", d, cfg.post_norms),
            )
        )
    embedding = tensor_matrix(get("token_embd.weight"), (cfg.vocab_size, d))
    lm_head = embedding if cfg.tied_embeddings else tensor_matrix(get("output.weight"), (cfg.vocab_size, d))
    return ModelWeights(embedding, tuple(layers), tensor_vector(get("output_norm.weight"), d), lm_head)


def _check_extent(reader: Any, path: Path) -> None:
    """A truncated file maps fine but its last tensors would run past the end: refuse it up front."""
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path.name} is truncated: tensor {t.name} ends past the file's {size} bytes")


def gguf_reader(path: Path) -> Any:
    import gguf

    array_type, string_type = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class PlainViewGGUFReader(gguf.GGUFReader):  # type: ignore[misc]
        """GGUFReader over a plain ndarray view of its memory map (still no copy; np.memmap's per-slice
        bookkeeping made parsing the ~100k tokenizer strings take seconds at start), reading arrays of
        a little-endian file whole: gguf-py builds two typed views per element of an array (a Qwen
        vocabulary's 151,936 tokens, their types and as many merges: ~2 s of every start); here an
        array is read in one pass, a plain slice per string. contents() is what gguf-py gives, whole
        or by index (tests/test_loading.py compares them)."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain_data = mapped.view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if raw_type != array_type or self.byte_order != "I" or not np.little_endian:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            offs, parts, types = orig_offs + 12, [item_type, count], [array_type, gguf.GGUFValueType(int(item_type[0]))]
            scalar = self.gguf_scalar_to_np.get(types[1])
            if scalar is not None:  # one read, then a one-element view per element as gguf-py's parts
                values = self._get(offs, scalar, int(count[0]))
                parts += list(values.reshape(-1, 1))
                return 12 + int(values.nbytes), parts, list(range(2, len(parts))), types
            if types[1] != string_type:
                return super()._get_field_parts(orig_offs, raw_type)
            data, raw = self.data, memoryview(self.data)
            for _ in range(int(count[0])):
                length = int.from_bytes(raw[offs : offs + 8], "little")
                parts.append(data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, len(parts))), types

    return PlainViewGGUFReader(path, "r")


def read_gguf_tokenizer(path: Path) -> GGUFTokenizerData:
    """Only the tokenizer of a GGUF file, whatever its architecture (no weights are touched)."""
    try:
        return _read_tokenizer(gguf_reader(path))
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - the gguf package raises many kinds on bad bytes
        raise ModelLoadError(f"{path.name}: no readable tokenizer ({type(exc).__name__}: {exc})") from None


def load_gguf(path: Path) -> tuple[ModelConfig, ModelWeights, GGUFTokenizerData]:
    try:
        reader = gguf_reader(path)
    except ModelLoadError:
        raise
    except Exception as exc:  # the gguf package raises ValueError, KeyError, IndexError… on bad bytes
        raise ModelLoadError(f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    try:
        _check_extent(reader, path)
        cfg = _read_config(reader, path.stem)
        return cfg, _read_weights(reader, cfg), _read_tokenizer(reader)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{path.name}: malformed GGUF ({type(exc).__name__}: {exc})") from None


def read_rerank_head(path: Path) -> tuple[str | None, np.ndarray | None]:
    """A reranker GGUF's prompt template (`tokenizer.chat_template.rerank`) and its `cls.output.weight`
    as float32 rows, each None where the file lacks it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    template = field_value(reader, "tokenizer.chat_template.rerank")
    tensor = next((t for t in reader.tensors if t.name == "cls.output.weight"), None)
    rows = None
    if tensor is not None:
        n_cols, n_rows = (int(d) for d in tensor.shape[:2]) if len(tensor.shape) >= 2 else (int(tensor.shape[0]), 1)
        rows = np.ascontiguousarray(tensor_matrix(tensor, (n_rows, n_cols)).dequantize(), dtype=np.float32)
    return (None if template is None else str(template)), rows
