"""`treadle bench synth SHAPE OUT.gguf`: a GGUF file with a real model's shapes, noise for weights.

    .venv/bin/treadle bench synth qwen2.5-7b /tmp/qwen2.5-7b-q4_k_m.gguf [--quant Q4_K_M|Q4_0|Q8_0]
        [--tokenizer FILE.gguf] [--layers N] [--seed S]
    .venv/bin/treadle bench synth --list

Speed and memory at the sizes people serve (1.5B-8B parameters, mixtures of experts) are measured on
files that have every tensor's real shape and storage type but random bytes: no such model ships on
the package registries this project can reach. Each file has

- the shape's hyperparameters (layers, widths, heads, vocabulary, RoPE) as the real model's GGUF says them;
- llama.cpp's type mix for the named file type (`llama_tensor_get_type` in llama.cpp's llama-quant.cpp):
  for Q4_K_M, Q4_K for most matrices and Q6_K for `attn_v` and `ffn_down` on its "more bits" layers
  and for the output head (the embedding too when the head is tied to it); a matrix whose row length
  is not a multiple of 256 falls back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K), as there;
- random quantized bits under bounded scales, so that dequantized weights spread like 1/sqrt(row
  length) and a forward pass stays finite through every layer;
- a real tokenizer copied from a GGUF file this project has (Qwen2.5-Coder-0.5B's for the qwen
  shapes once pulled, else SmolLM2's), its vocabulary padded with unused tokens to the shape's.

Tensors are written one after another, each in slices of rows, so writing an 18 GB file holds tens
of MB in memory. Both treadle and llama.cpp load the result.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from decoding.model.quant import BLOCK_SHAPES, FP16_FIELDS, QType, dequantize

log = logging.getLogger(__name__)

QK_K = 256
SLICE_BYTES = 32 << 20  # random bytes generated and written at a time


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The hyperparameters of one real model, as its GGUF file states them."""

    architecture: str  # GGUF's name: llama, qwen2, qwen3, qwen3moe
    n_layers: int
    dim: int
    hidden_dim: int  # feed-forward width (of one expert, for a mixture of experts)
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    tied_embeddings: bool
    head_dim: int = 0  # 0: dim // n_heads
    context_length: int = 32768
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    llama3_rope: bool = False  # llama 3.1+: per-pair frequency divisors in rope_freqs.weight
    n_experts: int = 0
    n_experts_used: int = 0
    tokenizer_family: str = "qwen"  # whose tokenizer the real model has

    @property
    def key_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads


SHAPES: dict[str, ModelShape] = {
    # for tests: every tensor kind of a qwen2 file, a few MB
    "tiny": ModelShape("qwen2", 2, 256, 512, 4, 2, 49152, True, tokenizer_family="smollm2"),
    "qwen2.5-0.5b": ModelShape("qwen2", 24, 896, 4864, 14, 2, 151936, True),
    "qwen2.5-1.5b": ModelShape("qwen2", 28, 1536, 8960, 12, 2, 151936, True),
    "qwen2.5-3b": ModelShape("qwen2", 36, 2048, 11008, 16, 2, 151936, True),
    "qwen2.5-7b": ModelShape("qwen2", 28, 3584, 18944, 28, 4, 152064, False),
    "qwen3-4b": ModelShape("qwen3", 36, 2560, 9728, 32, 8, 151936, True, head_dim=128, context_length=40960),
    "qwen3-8b": ModelShape(
        "qwen3", 36, 4096, 12288, 32, 8, 151936, False, head_dim=128, context_length=40960
    ),
    # a mixture of experts: 128 experts of width 768, 8 per token (~3.3B of its 30.5B parameters read per token)
    "qwen3-30b-a3b": ModelShape("qwen3moe", 48, 2048, 768, 32, 4, 151936, False, head_dim=128, context_length=40960,
                                n_experts=128, n_experts_used=8),
    "llama-3.2-3b": ModelShape(
        "llama",
        28,
        3072,
        8192,
        24,
        8,
        128256,
        True,
        context_length=131072,
        rope_theta=500_000.0,
        rms_eps=1e-5,
        llama3_rope=True,
        tokenizer_family="llama",
    ),
    "llama-3.1-8b": ModelShape(
        "llama",
        32,
        4096,
        14336,
        32,
        8,
        128256,
        False,
        context_length=131072,
        rope_theta=500_000.0,
        rms_eps=1e-5,
        llama3_rope=True,
        tokenizer_family="llama",
    ),
    "mistral-7b": ModelShape(
        "llama",
        32,
        4096,
        14336,
        32,
        8,
        32768,
        False,
        rope_theta=1_000_000.0,
        rms_eps=1e-5,
        tokenizer_family="llama",
    ),
}

# llama.cpp's file types (llama_ftype) and each one's default tensor type
FILE_TYPES = {"Q4_0": (2, QType.Q4_0), "Q8_0": (7, QType.Q8_0), "Q4_K_M": (15, QType.Q4_K)}
# llama.cpp's fallback where a row's length is not a multiple of the type's block (tensor_type_fallback)
_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: (experts,) rows, columns
    qtype: QType

    @property
    def n_bytes(self) -> int:
        *outer, cols = self.shape
        if self.qtype == QType.F32:
            return 4 * int(np.prod(self.shape))
        per_block, size = BLOCK_SHAPES[self.qtype]
        return int(np.prod(outer)) * cols // per_block * size


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fits(qtype: QType, n_cols: int) -> QType:
    per_block = BLOCK_SHAPES[qtype][0] if qtype in BLOCK_SHAPES else 1
    return qtype if n_cols % per_block == 0 else _FALLBACK[qtype]


def tensor_plan(shape: ModelShape, quant: str) -> list[TensorPlan]:
    """Every tensor of the file, in the order llama.cpp's converter writes them, with the storage type
    llama.cpp's quantizer picks for `quant` (its rules for the file types offered here)."""
    default = FILE_TYPES[quant][1]
    d, q, kv, h, n = (
        shape.dim,
        shape.n_heads * shape.key_dim,
        shape.n_kv_heads * shape.key_dim,
        shape.hidden_dim,
        shape.n_layers,
    )
    # the head (and a tied embedding, which llama.cpp quantizes as the head): Q6_K unless the file is Q8_0
    head_type = QType.Q8_0 if default == QType.Q8_0 or d % QK_K else QType.Q6_K
    embedding_type = head_type if shape.tied_embeddings else _fits(default, d)
    plans = [TensorPlan("token_embd.weight", (shape.vocab_size, d), embedding_type)]

    def matrix(name: str, rows: int, cols: int, more_bits: bool = False, experts: int = 0) -> TensorPlan:
        qtype = default
        if more_bits and quant == "Q4_K_M":
            qtype = QType.Q6_K
        return TensorPlan(name, ((experts,) if experts else ()) + (rows, cols), _fits(qtype, cols))

    for i in range(n):
        p, more_bits = f"blk.{i}.", _use_more_bits(i, n)
        plans.append(TensorPlan(p + "attn_norm.weight", (d,), QType.F32))
        plans += [
            matrix(p + "attn_q.weight", q, d),
            matrix(p + "attn_k.weight", kv, d),
            matrix(p + "attn_v.weight", kv, d, more_bits),
            matrix(p + "attn_output.weight", d, q),
        ]
        if shape.architecture == "qwen2":
            plans += [
                TensorPlan(p + f"attn_{x}.bias", (size,), QType.F32)
                for x, size in (("q", q), ("k", kv), ("v", kv))
            ]
        if shape.architecture in ("qwen3", "qwen3moe"):
            plans += [
                TensorPlan(p + f"attn_{x}_norm.weight", (shape.key_dim,), QType.F32) for x in ("q", "k")
            ]
        plans.append(TensorPlan(p + "ffn_norm.weight", (d,), QType.F32))
        if shape.n_experts:
            e = shape.n_experts
            plans += [
                TensorPlan(p + "ffn_gate_inp.weight", (e, d), QType.F32),
                matrix(p + "ffn_gate_exps.weight", h, d, experts=e),
                matrix(p + "ffn_up_exps.weight", h, d, experts=e),
                matrix(p + "ffn_down_exps.weight", d, h, more_bits, experts=e),
            ]
        else:
            plans += [
                matrix(p + "ffn_gate.weight", h, d),
                matrix(p + "ffn_up.weight", h, d),
                matrix(p + "ffn_down.weight", d, h, more_bits),
            ]
    plans.append(TensorPlan("output_norm.weight", (d,), QType.F32))
    if not shape.tied_embeddings:
        plans.append(TensorPlan("output.weight", (shape.vocab_size, d), head_type))
    if shape.llama3_rope:
        plans.append(TensorPlan("rope_freqs.weight", (shape.key_dim // 2,), QType.F32))
    return plans


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> np.ndarray:
    """Llama 3.1's per-pair frequency divisors, as its converter writes rope_freqs.weight."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelengths = 2 * np.pi / freqs
    low_wavelength, high_wavelength = original_context / low_freq_factor, original_context / high_freq_factor
    smooth = (original_context / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisors = np.where(
        wavelengths < high_wavelength,
        1.0,
        np.where(wavelengths > low_wavelength, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    return divisors.astype(np.float32)


def _unit_spread(qtype: QType, rng: np.random.Generator) -> float:
    """The standard deviation of weights dequantized from random bits with every fp16 scale at 1."""
    per_block, size = BLOCK_SHAPES[qtype]
    blocks = rng.integers(0, 256, (64, 4, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[..., offset : offset + 2] = np.ones(blocks.shape[:2], np.float16)[..., None].view(np.uint8)
    return float(dequantize(blocks.reshape(64, -1), qtype, 4 * per_block).std())


def random_blocks(
    qtype: QType, n_rows: int, n_cols: int, spread: float, rng: np.random.Generator
) -> np.ndarray:
    """(n_rows, row bytes) uint8 of `qtype` blocks: every quantized bit random, the fp16 scales (and
    mins) chosen so the dequantized weights have about standard deviation `spread`."""
    per_block, size = BLOCK_SHAPES[qtype]
    blocks = (
        np.frombuffer(rng.bytes(n_rows * (n_cols // per_block) * size), np.uint8)
        .reshape(n_rows, -1, size)
        .copy()
    )
    factor = spread / _unit_spread(qtype, np.random.default_rng(0))
    for offset in FP16_FIELDS[qtype]:
        scale = (factor * (0.5 + rng.random(blocks.shape[:2], np.float32))).astype(np.float16)
        blocks[..., offset : offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(n_rows, -1)


def _tensor_slices(plan: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's bytes, a slice of rows at a time."""
    if plan.qtype == QType.F32:
        size = int(np.prod(plan.shape))
        if plan.name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(size)  # norms near one, as trained ones are
        else:
            values = 0.02 * rng.standard_normal(size)  # biases, the router
        yield values.astype(np.float32)
        return
    *outer, cols = plan.shape
    rows = int(np.prod(outer))
    per_row = plan.n_bytes // rows
    step = max(1, SLICE_BYTES // per_row)
    for start in range(0, rows, step):
        yield random_blocks(plan.qtype, min(step, rows - start), cols, cols**-0.5, rng)


def default_tokenizer(shape: ModelShape) -> Path:
    """The GGUF whose tokenizer a shape gets: the family's real one where it is here and fits the
    vocabulary, else SmolLM2's (the default model's, always installed), padded."""
    from decoding.model.catalog import KNOWN_MODELS, locate

    candidates = (["qwen2.5-coder-0.5b-instruct"] if shape.tokenizer_family == "qwen" else []) + [
        "smollm2-135m-instruct"
    ]
    for name in candidates:
        path = locate(KNOWN_MODELS[name])
        if path is not None:
            if name != candidates[0]:
                log.warning(
                    "the %s tokenizer is not here (`treadle pull %s`): using %s's",
                    shape.tokenizer_family,
                    candidates[0],
                    name,
                )
            return path
    raise SystemExit(
        "no tokenizer source: `treadle pull qwen2.5-coder-0.5b-instruct`, or pass --tokenizer FILE.gguf"
    )


def _copy_tokenizer(writer, source: Path, vocab_size: int) -> None:  # type: ignore[no-untyped-def]
    """Every `tokenizer.*` key of `source`, its per-token arrays padded with unused tokens to `vocab_size`."""
    import gguf

    reader = gguf.GGUFReader(source, "r")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    if len(tokens) > vocab_size:
        raise SystemExit(
            f"{source.name}'s tokenizer has {len(tokens)} tokens, more than the shape's vocabulary "
            f"of {vocab_size}: choose a smaller one with --tokenizer"
        )
    pad = vocab_size - len(tokens)
    padding = {
        "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(tokens), vocab_size)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
        "tokenizer.ggml.scores": [-1000.0] * pad,
    }
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, list(value) + padding.get(key, []), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)


def write_model(
    shape: str | ModelShape,
    out: Path,
    quant: str = "Q4_K_M",
    tokenizer: Path | None = None,
    n_layers: int | None = None,
    seed: int = 0,
) -> list[TensorPlan]:
    """Write the file (`shape` by its name in SHAPES, or given whole); returns its tensors as planned."""
    import gguf

    shape_name = shape if isinstance(shape, str) else "custom"
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    if n_layers is not None:
        shape = replace(shape, n_layers=n_layers)
    plans = tensor_plan(shape, quant)
    arch = shape.architecture
    writer = gguf.GGUFWriter(out.with_name(out.name + ".partial"), arch)
    writer.add_name(f"{shape_name} shape ({quant}, random weights)")
    writer.add_file_type(FILE_TYPES[quant][0])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(shape.n_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.dim)
    writer.add_feed_forward_length(shape.hidden_dim)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab_size)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.key_dim)
    if shape.n_experts:
        writer.add_expert_count(shape.n_experts)
        writer.add_expert_used_count(shape.n_experts_used)
        writer.add_expert_feed_forward_length(shape.hidden_dim)
    _copy_tokenizer(writer, tokenizer or default_tokenizer(shape), shape.vocab_size)
    for plan in plans:
        if plan.qtype == QType.F32:
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.n_bytes)
        else:  # the gguf package takes a quantized tensor's shape in bytes per row
            *outer, _ = plan.shape
            byte_shape = (*outer, plan.n_bytes // int(np.prod(outer)))
            writer.add_tensor_info(
                plan.name,
                byte_shape,
                np.dtype(np.uint8),
                plan.n_bytes,
                raw_dtype=gguf.GGMLQuantizationType(int(plan.qtype)),
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    fout = writer.fout[0]
    for plan in plans:
        writer.write_padding(fout, fout.tell())
        if plan.name == "rope_freqs.weight":
            llama3_rope_factors(shape.key_dim, shape.rope_theta).tofile(fout)
        else:
            for part in _tensor_slices(plan, rng):
                part.tofile(fout)
        writer.write_padding(fout, plan.n_bytes)
    writer.close()
    out.with_name(out.name + ".partial").replace(out)
    return plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="treadle bench synth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--quant", choices=sorted(FILE_TYPES), default="Q4_K_M")
    parser.add_argument("--tokenizer", type=Path, help="a GGUF file whose tokenizer to copy")
    parser.add_argument("--layers", type=int, help="fewer layers than the real model (same widths)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="list the shapes, their sizes and type mix")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.list or args.shape is None:
        for name, shape in SHAPES.items():
            plans = tensor_plan(shape, args.quant)
            params = sum(int(np.prod(p.shape)) for p in plans)
            counts: dict[str, int] = {}
            for p in plans:
                counts[p.qtype.name] = counts.get(p.qtype.name, 0) + 1
            print(
                f"{name:14} {shape.architecture:8} {params / 1e9:6.2f}B parameters  "
                f"{sum(p.n_bytes for p in plans) / 1e9:6.2f} GB  {counts}"
            )
        return 0
    if args.out is None:
        parser.error("OUT.gguf is required")
    started = time.perf_counter()
    plans = write_model(args.shape, args.out, args.quant, args.tokenizer, args.layers, args.seed)
    print(
        f"{args.out}: {len(plans)} tensors, {args.out.stat().st_size / 1e9:.2f} GB in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
