"""Load a Hugging Face Llama checkpoint (config.json, *.safetensors, tokenizer.json) into treadle's form.

safetensors is an 8-byte little-endian header length, a JSON header (name → dtype, shape, byte
offsets), then raw tensor bytes. We map each tensor straight out of the file (np.memmap), so float
weights are not copied; the `safetensors` package's numpy loader would copy them and cannot hold bf16.

Query and key rows are permuted into ggml's rotary order (adjacent pairs), exactly as llama.cpp's
convert_hf_to_gguf.py does, so one RoPE kernel serves both sources.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .errors import ModelLoadError
from .quant import QType
from .weights import LayerWeights, ModelWeights, WeightMatrix

_DTYPES = {"F32": (np.float32, QType.F32), "F16": (np.float16, QType.F16), "BF16": (np.uint16, QType.BF16)}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _map_file(path: Path) -> dict[str, tuple[np.ndarray, QType]]:
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(f"{path.name} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ModelLoadError(f"{path.name} has a corrupt or truncated safetensors header")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise ModelLoadError(f"{path.name} has an unreadable safetensors header ({exc})") from None
    data_start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype_name = info.get("dtype")
        if dtype_name not in _DTYPES:
            raise ModelLoadError(f"{path.name}: tensor {name} has dtype {dtype_name}; treadle reads F32, F16, BF16")
        np_dtype, qtype = _DTYPES[dtype_name]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if data_start + end > size or end - begin != int(np.prod(shape)) * np.dtype(np_dtype).itemsize:
            raise ModelLoadError(f"{path.name} is truncated or inconsistent at tensor {name}")
        array = np.memmap(path, dtype=np_dtype, mode="r", offset=data_start + begin, shape=shape)
        tensors[name] = (array, qtype)
    return tensors


def _permute_for_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's rotate-half layout → ggml's adjacent-pair layout (convert_hf_to_gguf's permute)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def read_config(directory: Path) -> ModelConfig:
    try:
        cfg: dict[str, Any] = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory / 'config.json'} is not readable JSON ({exc})") from None
    arch = cfg.get("model_type")
    if arch != "llama":
        raise ModelLoadError(f"unsupported architecture {arch!r} in config.json (treadle runs llama)")
    if cfg.get("rope_scaling"):
        raise ModelLoadError(f"rope_scaling {cfg['rope_scaling']} is not supported")
    try:
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        return ModelConfig(
            architecture="llama",
            n_layers=int(cfg["num_hidden_layers"]),
            dim=dim,
            hidden_dim=int(cfg["intermediate_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            vocab_size=int(cfg["vocab_size"]),
            max_context=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            add_bos_token=False,
            name=directory.name,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{directory / 'config.json'}: missing or invalid field ({exc})") from None


def load_safetensors_directory(directory: Path, cfg: ModelConfig) -> ModelWeights:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors files")
    tensors: dict[str, tuple[np.ndarray, QType]] = {}
    for f in files:
        tensors.update(_map_file(f))

    def get(name: str) -> tuple[np.ndarray, QType]:
        if name not in tensors:
            raise ModelLoadError(f"checkpoint lacks tensor '{name}'")
        return tensors[name]

    def matrix(name: str, shape: tuple[int, int], rope_heads: int = 0) -> WeightMatrix:
        data, qtype = get(name)
        if tuple(data.shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(data.shape)}, expected {shape}")
        if rope_heads:
            data = _permute_for_rope(data, rope_heads)
        return WeightMatrix(qtype, shape[0], shape[1], data)

    def vector(name: str) -> np.ndarray:
        data, qtype = get(name)
        if data.shape != (cfg.dim,):
            raise ModelLoadError(f"tensor {name} has shape {data.shape}, expected ({cfg.dim},)")
        return WeightMatrix(qtype, 1, cfg.dim, data.reshape(1, -1)).dequantize().reshape(cfg.dim)

    d, q, kv, h = cfg.dim, cfg.q_dim, cfg.kv_dim, cfg.hidden_dim
    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                attn_norm=vector(p + "input_layernorm.weight"),
                wq=matrix(p + "self_attn.q_proj.weight", (q, d), rope_heads=cfg.n_heads),
                wk=matrix(p + "self_attn.k_proj.weight", (kv, d), rope_heads=cfg.n_kv_heads),
                wv=matrix(p + "self_attn.v_proj.weight", (kv, d)),
                wo=matrix(p + "self_attn.o_proj.weight", (d, q)),
                ffn_norm=vector(p + "post_attention_layernorm.weight"),
                w_gate=matrix(p + "mlp.gate_proj.weight", (h, d)),
                w_up=matrix(p + "mlp.up_proj.weight", (h, d)),
                w_down=matrix(p + "mlp.down_proj.weight", (d, h)),
            )
        )
    embedding = matrix("model.embed_tokens.weight", (cfg.vocab_size, d))
    tied = cfg.tied_embeddings or "lm_head.weight" not in tensors
    lm_head = embedding if tied else matrix("lm_head.weight", (cfg.vocab_size, d))
    return ModelWeights(embedding, tuple(layers), vector("model.norm.weight"), lm_head)
