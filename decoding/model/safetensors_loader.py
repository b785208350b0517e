"""Load a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json) into treadle's form.

Architectures (config.json's model_type): llama, mistral, qwen2, qwen3, gemma3_text, and the mixtures of
experts qwen3_moe and mixtral (experts one tensor each, as their checkpoints ship, or stacked as
transformers 5 holds them in memory).

safetensors is an 8-byte little-endian header length, a JSON header (name → dtype, shape, byte
offsets), then raw tensor bytes. We map each tensor straight out of the file (np.memmap), so float
weights are not copied; the `safetensors` package's numpy loader would copy them and cannot hold bf16.

Query and key rows stay in Hugging Face's order (RoPE pairs dimensions i and i + head_dim/2), so
nothing is copied; Gemma's norm weights w become 1 + w, the factor they stand for.
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
_BUFFERS = ("position_ids",)  # integer buffers older transformers saved beside the weights (BERT's)


def map_safetensors(path: Path) -> dict[str, tuple[np.ndarray, QType]]:
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
        if name == "__metadata__" or name.endswith(_BUFFERS):
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


HF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral")
_TREADLE_NAMES = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}


def _rope(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """Rotary parameters (rope_theta, rope_type, scaling fields) in either config format:
    transformers 4's `rope_theta` + `rope_scaling`, or 5's `rope_parameters` (per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict):
        return {"rope_type": "default", **params}
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return {**scaling, "rope_type": kind, "rope_theta": cfg.get("rope_theta", 10000.0)}


def llama3_frequency_factors(rope: dict[str, Any], head_dim: int) -> tuple[float, ...]:
    """Llama 3.1's rope scaling as the divisor of each pair's frequency (what GGUF's rope_freqs holds)."""
    theta = float(rope["rope_theta"])
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / inv_freq
    smooth = np.clip((old_context / wavelength - low) / (high - low), 0.0, 1.0)
    # long wavelengths slow down by `factor`, short ones keep theirs, the band between is interpolated
    scaled = np.where(wavelength > old_context / low, inv_freq / factor,
                      np.where(wavelength < old_context / high, inv_freq,
                               (1 - smooth) * inv_freq / factor + smooth * inv_freq))  # fmt: skip
    return tuple(float(f) for f in inv_freq / scaled)


def _switches(cfg: dict[str, Any], arch: str, n_layers: int, head_dim: int) -> dict[str, Any]:
    """The ModelConfig switches of one architecture, from its config.json."""
    for field_name in ("mlp_bias", "attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(field_name):
            raise ModelLoadError(f"config.json sets {field_name}, which treadle does not run")
    switches: dict[str, Any] = {"rope_neox": True}
    rope = _rope(cfg)
    switches["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    if rope["rope_type"] == "llama3":
        switches["rope_freq_factors"] = llama3_frequency_factors(rope, head_dim)
    elif rope["rope_type"] == "linear":
        switches["rope_linear_factor"] = float(rope["factor"])
    elif rope["rope_type"] != "default":
        raise ModelLoadError(f"rope scaling {rope['rope_type']!r} is not supported (treadle runs linear and llama3)")
    switches["qkv_bias"] = arch == "qwen2" or bool(cfg.get("attention_bias"))
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window"):
        window = None  # Qwen2 configs name a window they do not use
    if window and layer_types:
        switches.update(
            sliding_window=int(window), sliding_layers=tuple(t == "sliding_attention" for t in layer_types)
        )
    elif window:
        switches["sliding_window"] = int(window)
    if arch in ("qwen3", "qwen3_moe"):
        switches["qk_norm"] = True
    if arch in ("qwen3_moe", "mixtral"):
        switches.update(_experts(cfg, arch, n_layers))
    if arch == "gemma3_text":
        if not layer_types:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            switches["sliding_layers"] = tuple((i + 1) % pattern != 0 for i in range(n_layers))
        local = _rope(cfg, "sliding_attention")
        switches.update(
            qk_norm=True, post_norms=True, activation="gelu_tanh",
            embedding_scale=float(np.sqrt(np.float32(cfg["hidden_size"]))),
            attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            rope_theta_local=float(cfg.get("rope_local_base_freq", local.get("rope_theta", 10000.0))),
        )  # fmt: skip
    elif cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch}")
    return switches


def _experts(cfg: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """A mixture of experts' switches: every layer sparse (Qwen3-MoE's dense layers are refused)."""
    if arch == "qwen3_moe":
        sparse = [i for i in range(n_layers) if i not in cfg.get("mlp_only_layers", [])
                  and (i + 1) % int(cfg.get("decoder_sparse_step", 1)) == 0]  # fmt: skip
        if len(sparse) != n_layers:
            raise ModelLoadError("layers with a dense feed-forward inside a mixture of experts are not supported")
        if cfg.get("shared_expert_intermediate_size"):
            raise ModelLoadError("shared experts are not supported (treadle runs qwen3moe and Mixtral-style experts)")
    return {
        # Qwen3-MoE checkpoints say num_experts; transformers 5 writes num_local_experts for both
        "n_experts": int(cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"]),
        "n_experts_used": int(cfg["num_experts_per_tok"]),
        "hidden_dim": int(cfg["moe_intermediate_size"] if arch == "qwen3_moe" else cfg["intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) if arch == "qwen3_moe" else True,
    }


def read_config(directory: Path) -> ModelConfig:
    try:
        cfg: dict[str, Any] = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory / 'config.json'} is not readable JSON ({exc})") from None
    arch = cfg.get("model_type")
    if arch not in HF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in config.json "
                             f"(treadle runs {', '.join(HF_ARCHITECTURES)})")
    try:
        n_heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        dim = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or dim // n_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        switches = _switches(cfg, arch, n_layers, head_dim)
        switches.setdefault("hidden_dim", int(cfg["intermediate_size"]))
        return ModelConfig(
            architecture=_TREADLE_NAMES.get(arch, arch),
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            max_context=int(cfg.get("max_position_embeddings", 2048)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3_text")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            add_bos_token=False,
            name=directory.name,
            **switches,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{directory / 'config.json'}: missing or invalid field ({exc})") from None


def load_safetensors_directory(directory: Path, cfg: ModelConfig) -> ModelWeights:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors files")
    tensors: dict[str, tuple[np.ndarray, QType]] = {}
    for f in files:
        tensors.update(map_safetensors(f))

    def get(name: str) -> tuple[np.ndarray, QType]:
        if name not in tensors:
            raise ModelLoadError(f"checkpoint lacks tensor '{name}'")
        return tensors[name]

    def matrix(name: str, shape: tuple[int, int]) -> WeightMatrix:
        data, qtype = get(name)
        if tuple(data.shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(data.shape)}, expected {shape}")
        return WeightMatrix(qtype, shape[0], shape[1], data)

    norm_offset = 1.0 if cfg.architecture == "gemma3" else 0.0

    def vector(name: str, length: int = cfg.dim, offset: float = 0.0) -> np.ndarray:
        data, qtype = get(name)
        if data.shape != (length,):
            raise ModelLoadError(f"tensor {name} has shape {data.shape}, expected ({length},)")
        return WeightMatrix(qtype, 1, length, data.reshape(1, -1)).dequantize().reshape(length) + np.float32(
            offset
        )

    def norm(name: str, length: int = cfg.dim) -> np.ndarray:
        return vector(name, length, norm_offset)

    def stacked(parts: list[np.ndarray], qtype: QType, shape: tuple[int, int]) -> WeightMatrix:
        """Experts back to back as one matrix (a copy: checkpoints keep each expert apart)."""
        data = np.concatenate([np.asarray(part).reshape(shape) for part in parts])
        return WeightMatrix(qtype, data.shape[0], shape[1], data)

    def feed_forward(p: str) -> dict[str, Any]:
        if not cfg.is_moe:
            return dict(w_gate=matrix(p + "mlp.gate_proj.weight", (h, d)),
                        w_up=matrix(p + "mlp.up_proj.weight", (h, d)),
                        w_down=matrix(p + "mlp.down_proj.weight", (d, h)))  # fmt: skip
        e = cfg.n_experts
        block = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in tensors else "mlp.")
        router = matrix(block + "gate.weight", (e, d)).dequantize()
        if block + "experts.gate_up_proj" in tensors:  # transformers 5's stacked form
            gate_up, qtype = get(block + "experts.gate_up_proj")
            down, _ = get(block + "experts.down_proj")
            if gate_up.shape != (e, 2 * h, d) or down.shape != (e, d, h):
                raise ModelLoadError(f"{block}experts has shapes {gate_up.shape} and {down.shape}")
            return dict(w_gate=stacked([gate_up[:, :h]], qtype, (e * h, d)),
                        w_up=stacked([gate_up[:, h:]], qtype, (e * h, d)),
                        w_down=stacked([down], qtype, (e * d, h)), router=router)  # fmt: skip
        names = ("w1", "w3", "w2") if "block_sparse_moe" in block else ("gate_proj", "up_proj", "down_proj")
        out: dict[str, Any] = {"router": router}
        for field_name, name, shape in zip(("w_gate", "w_up", "w_down"), names, ((h, d), (h, d), (d, h)), strict=True):
            parts = [matrix(f"{block}experts.{i}.{name}.weight", shape) for i in range(e)]
            out[field_name] = stacked([m.data for m in parts], parts[0].qtype, shape)
        return out

    def optional(name: str, length: int, present: bool, as_norm: bool = False) -> np.ndarray | None:
        if not present:
            return None
        return norm(name, length) if as_norm else vector(name, length)

    d, q, kv, h, hd = cfg.dim, cfg.q_dim, cfg.kv_dim, cfg.hidden_dim, cfg.head_dim
    gemma = cfg.architecture == "gemma3"
    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                attn_norm=norm(p + "input_layernorm.weight"),
                wq=matrix(p + "self_attn.q_proj.weight", (q, d)),
                wk=matrix(p + "self_attn.k_proj.weight", (kv, d)),
                wv=matrix(p + "self_attn.v_proj.weight", (kv, d)),
                wo=matrix(p + "self_attn.o_proj.weight", (d, q)),
                ffn_norm=norm(
                    p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")
                ),
                **feed_forward(p),
                q_bias=optional(p + "self_attn.q_proj.bias", q, cfg.qkv_bias),
                k_bias=optional(p + "self_attn.k_proj.bias", kv, cfg.qkv_bias),
                v_bias=optional(p + "self_attn.v_proj.bias", kv, cfg.qkv_bias),
                q_norm=optional(p + "self_attn.q_norm.weight", hd, cfg.qk_norm, as_norm=True),
                k_norm=optional(p + "self_attn.k_norm.weight", hd, cfg.qk_norm, as_norm=True),
                post_attn_norm=optional(
                    p + "post_attention_layernorm.weight", d, cfg.post_norms, as_norm=True
                ),
                post_ffn_norm=optional(
                    p + "post_feedforward_layernorm.weight", d, cfg.post_norms, as_norm=True
                ),
            )
        )
    embedding = matrix("model.embed_tokens.weight", (cfg.vocab_size, d))
    tied = cfg.tied_embeddings or "lm_head.weight" not in tensors
    lm_head = embedding if tied else matrix("lm_head.weight", (cfg.vocab_size, d))
    return ModelWeights(embedding, tuple(layers), norm("model.norm.weight"), lm_head)
