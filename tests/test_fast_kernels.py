"""The VNNI kernels against numpy on the same int8 activations: only float rounding may differ."""

import itertools

import numpy as np
import pytest

from bench.kernels import store_as
from decoding.kernels.amx import tile_activations, tile_scratch
from decoding.kernels.fast_kernels import (
    activation_arrays,
    matmul_groups,
    quantize_activation_row,
    swiglu_groups,
    tokens_per_pass,
)
from decoding.kernels.kernels import GATE_GELU_TANH, GATE_SILU
from decoding.kernels.reference import gate_activation
from decoding.kernels.repack import ACTIVATION_ORDER, repack
from decoding.model.quant import QType, dequantize, quantize

UNTILED = (tile_activations(0, 0, 0), np.zeros(0, np.float32))  # the kernels' AMX arguments, unused


def quantized_activations(x: np.ndarray):
    tokens, cols = x.shape
    xq, xd, xsum = activation_arrays(tokens, cols + 96)  # wider than used, as the engine's scratch is
    for t in range(tokens):
        quantize_activation_row(x[t], cols, xq[t], xd[t], xsum[t])
    return xq, xd, xsum


def dequantized_activations(xq, xd, cols: int) -> np.ndarray:
    """What the int8 activations stand for, in natural weight order."""
    inverse = np.argsort(ACTIVATION_ORDER)
    blocks = xq[:, :cols].reshape(xq.shape[0], cols // 32, 32)[..., inverse].astype(np.float32)
    return (blocks * xd[:, : cols // 32, 0, None]).reshape(xq.shape[0], cols)


def test_activation_quantization_is_q8_0_with_round_half_away():
    x = np.array([[0.5, -0.5, 1.5, -2.5] + [0.0] * 27 + [127.0]], dtype=np.float32)
    xq, xd, xsum = quantized_activations(x)
    restored = dequantized_activations(xq, xd, 32)
    np.testing.assert_array_equal(restored, np.round(x + np.sign(x) * 1e-6))  # scale 1: q = round-half-away(x)
    # per block: the scale, and Σq over weights 0..15 and 16..31, and the scale times their total
    assert xd[0, 0, 0] == 1.0 and list(xsum[0, 0]) == [1 - 1 + 2 - 3, 127] and xd[0, 0, 1] == 126.0


def q8_0_in_numpy(x: np.ndarray, cols: int):
    """The quantization as llama.cpp's quantize_row_q8_0 writes it, one float32 operation at a time: scale
    amax / 127, values × (127 / amax) rounded half away from zero; bytes in the kernels' step order."""
    blocks = x[:, :cols].reshape(x.shape[0], cols // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    scaled = (blocks * inverse[..., None]).astype(np.float32)
    q = np.where(scaled >= 0, scaled + np.float32(0.5), scaled - np.float32(0.5)).astype(np.float32).astype(np.int32)
    sums = np.stack([q[..., :16].sum(axis=2), q[..., 16:].sum(axis=2)], axis=2).astype(np.int32)
    mass = (sums.sum(axis=2).astype(np.float32) * scale).astype(np.float32)
    return (q[..., ACTIVATION_ORDER].astype(np.int8).reshape(x.shape[0], cols), np.stack([scale, mass], axis=2),
            sums)


def test_the_vector_quantization_gives_numpys_bytes_scales_and_sums_to_the_bit():
    rng = np.random.default_rng(7)
    cols = 8960  # a 1.5B's hidden row
    x = rng.standard_normal((6, cols)).astype(np.float32) * np.float32([[0.01], [1], [3], [40], [1e4], [1e-20]])
    x[0, :32] = 0.0  # a block of zeros: scale 0, every byte 0
    x[1, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # exact halves after scaling: the rounding's ties
    x[1, 64:96] = -0.0
    x[2, 96:128] = np.float32(5.0)  # every value at the scale's extreme
    xq, xd, xsum = quantized_activations(x)
    expected_q, expected_d, expected_sums = q8_0_in_numpy(x, cols)
    np.testing.assert_array_equal(xq[:, :cols], expected_q)
    np.testing.assert_array_equal(xd[:, : cols // 32].view(np.int32), expected_d.view(np.int32))
    np.testing.assert_array_equal(xsum[:, : cols // 32], expected_sums)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_group_dot_products_equal_numpy_on_the_same_quantized_inputs(qtype, tokens):
    rng = np.random.default_rng(int(qtype) * 10 + tokens)
    rows, cols = 48, 320
    stored = store_as(rng.standard_normal((rows, cols)).astype(np.float32), qtype, rng)
    x = rng.standard_normal((tokens, cols)).astype(np.float32) * 3
    xq, xd, xsum = quantized_activations(x)
    expected = (dequantized_activations(xq, xd, cols).astype(np.float64)
                @ dequantize(stored, qtype, cols).T.astype(np.float64))
    out = np.full((tokens, rows + 5), np.nan, np.float32)
    matmul_groups(repack(stored, qtype, rows, cols), int(qtype), cols, xq, xd, xsum, tokens, out, 0, rows // 8, False,
                  np.zeros((8, 8), np.float32), *UNTILED)
    np.testing.assert_allclose(out[:, :rows], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert np.isnan(out[:, rows:]).all()  # nothing written past the matrix


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q6_K, QType.Q4_K],
                         ids=lambda q: q.name)
def test_groups_of_eight_and_four_tokens_give_the_same_bits_as_one_at_a_time(qtype):
    """13 tokens run as one call of 8, one of 4 and one of 1: each token's bits are its own alone."""
    from decoding.kernels.repack import packed_type

    rng = np.random.default_rng(3 + int(qtype))
    rows, cols, tokens = 64, 512, 13
    stored = store_as(rng.standard_normal((rows, cols)).astype(np.float32) / 20, qtype, rng)
    packed, form = repack(stored, qtype, rows, cols), int(packed_type(qtype))
    xq, xd, xsum = quantized_activations(rng.standard_normal((tokens, cols)).astype(np.float32))
    together = np.zeros((tokens, rows), np.float32)
    matmul_groups(packed, form, cols, xq, xd, xsum, tokens, together, 0, 8, False, np.zeros((8, 8), np.float32),
                  *UNTILED)
    for t in range(tokens):
        alone = np.zeros((1, rows), np.float32)
        matmul_groups(packed, form, cols, xq[t : t + 1], xd[t : t + 1], xsum[t : t + 1], 1, alone, 0, 8,
                      False, np.zeros((8, 8), np.float32), *UNTILED)
        np.testing.assert_array_equal(alone[0], together[t])


@pytest.mark.parametrize("tiled", [False, True], ids=["vnni", "emulated-tiles"])
@pytest.mark.parametrize("qtype", [QType.Q6_K, QType.Q4_K], ids=lambda q: q.name)
def test_a_prompt_in_passes_gives_every_token_the_bits_it_gets_alone(qtype, tiled):
    """45 tokens of a wide matrix go in passes of 16 (their activations fill the pass): 16 + 16 + 8 + 4 + 1
    (the first 32 through the tiles' emulation where tiled), and through the gated unit too; every token's
    outputs are those it gets alone."""
    from decoding.kernels.amx import EMULATED, tile_activation_row
    from decoding.kernels.repack import packed_type

    rng = np.random.default_rng(7 + int(qtype))
    rows, cols, tokens = 16, 33 * 256, 45
    assert tokens_per_pass(cols) == 16  # more than two passes and a remainder
    weights = [store_as(rng.standard_normal((rows, cols)).astype(np.float32) / 90, qtype, rng) for _ in range(2)]
    form = int(packed_type(qtype))
    gate, up = (repack(w, qtype, rows, cols) for w in weights)
    xq, xd, xsum = quantized_activations(rng.standard_normal((tokens, cols)).astype(np.float32))
    tiles = tile_activations(EMULATED, tokens, cols) if tiled else UNTILED[0]
    for t in range(32 if tiled else 0):
        tile_activation_row(tiles, t, cols, xq[t], xd[t], xsum[t])

    def run(first: int, count: int, tiles):
        rows_of = slice(first, first + count)
        scratch = tile_scratch(1, tiles.mode, cols, count)[0]
        projected, gated, up_out = (np.zeros((count, rows), np.float32) for _ in range(3))
        matmul_groups(gate, form, cols, xq[rows_of], xd[rows_of], xsum[rows_of], count, projected, 0, rows // 8,
                      False, np.zeros((8, 8), np.float32), tiles, scratch[0])
        swiglu_groups(gate, up, form, form, cols, xq[rows_of], xd[rows_of], xsum[rows_of], count, gated, up_out, 0,
                      rows // 8, np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32), GATE_SILU,
                      tiles, scratch)
        return projected, gated

    projected, gated = run(0, tokens, tiles)
    for t in range(tokens):
        alone_projected, alone_gated = run(t, 1, UNTILED[0])
        np.testing.assert_array_equal(alone_projected[0], projected[t])
        np.testing.assert_array_equal(alone_gated[0], gated[t])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_accumulate_adds_to_the_residual_and_the_gated_unit_combines_both_projections(activation):
    rng = np.random.default_rng(4)
    rows, cols, tokens = 16, 64, 5
    gate = quantize(rng.standard_normal((rows, cols)).astype(np.float32), QType.Q8_0)
    up = quantize(rng.standard_normal((rows, cols)).astype(np.float32), QType.Q4_1)
    xq, xd, xsum = quantized_activations(rng.standard_normal((tokens, cols)).astype(np.float32))
    x = dequantized_activations(xq, xd, cols)
    residual = rng.standard_normal((tokens, rows)).astype(np.float32)
    out = residual.copy()
    matmul_groups(repack(gate, QType.Q8_0, rows, cols), int(QType.Q8_0), cols, xq, xd, xsum, tokens, out, 0, 2, True,
                  np.zeros((8, 8), np.float32), *UNTILED)
    np.testing.assert_allclose(out, residual + x @ dequantize(gate, QType.Q8_0, cols).T, rtol=1e-4, atol=1e-4)
    hidden, up_scratch = np.zeros((tokens, rows), np.float32), np.zeros((tokens, rows), np.float32)
    swiglu_groups(repack(gate, QType.Q8_0, rows, cols), repack(up, QType.Q4_1, rows, cols), int(QType.Q8_0),
                  int(QType.Q4_1), cols, xq, xd, xsum, tokens, hidden, up_scratch, 0, 2, np.zeros((8, 8), np.float32),
                  np.zeros((8, 8), np.float32), GATE_GELU_TANH if activation == "gelu_tanh" else GATE_SILU,
                  UNTILED[0], np.zeros((2, 0), np.float32))
    g = x @ dequantize(gate, QType.Q8_0, cols).T
    u = x @ dequantize(up, QType.Q4_1, cols).T
    np.testing.assert_allclose(hidden, gate_activation(g, activation) * u, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_q4_k_runs_in_its_own_form_with_the_exact_weights(tokens):
    """Its 6-bit scales and mins kept as bytes, d·scale and dmin·min formed in float32: the kernel's
    only error is the activations' int8 rounding."""
    from decoding.kernels.repack import packed_nbytes, packed_type

    rng = np.random.default_rng(30 + tokens)
    rows, cols = 48, 768
    stored = store_as(rng.standard_normal((rows, cols)).astype(np.float32) / 20, QType.Q4_K, rng)
    stored[:8, 0:2] = np.float16(3000.0).reshape(1, 1).view(np.uint8)  # d·scale past fp16's range: still exact
    assert packed_type(QType.Q4_K) == QType.Q4_K
    packed = repack(stored, QType.Q4_K, rows, cols)
    assert packed.nbytes == packed_nbytes(QType.Q4_K, rows, cols) == stored.nbytes * 148 * 8 // 1152
    x = rng.standard_normal((tokens, cols)).astype(np.float32) * 3
    xq, xd, xsum = quantized_activations(x)
    activations = dequantized_activations(xq, xd, cols).astype(np.float64)
    out = np.full((tokens, rows), np.nan, np.float32)
    matmul_groups(packed, int(QType.Q4_K), cols, xq, xd, xsum, tokens, out, 0, rows // 8, False,
                  np.zeros((8, 8), np.float32), *UNTILED)  # fmt: skip
    expected = activations @ dequantize(stored, QType.Q4_K, cols).T.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_q5_k_runs_on_the_kernel_of_its_sub_blocks_form_with_fp16_scale_and_min(tokens):
    from decoding.kernels.repack import packed_type, q5_k_as_q5_1

    qtype = QType.Q5_K
    rng = np.random.default_rng(40 + tokens + int(qtype))
    rows, cols = 48, 512
    stored = store_as(rng.standard_normal((rows, cols)).astype(np.float32) / 20, qtype, rng)
    form = packed_type(qtype)
    converted_rows = q5_k_as_q5_1(stored, cols)
    exact_weights, converted = dequantize(stored, qtype, cols), dequantize(converted_rows, form, cols)
    # the conversion only rounds each sub-block's d·scale and dmin·min to fp16
    np.testing.assert_allclose(converted, exact_weights, rtol=0, atol=2e-3 * np.abs(exact_weights).max())
    x = rng.standard_normal((tokens, cols)).astype(np.float32) * 3
    xq, xd, xsum = quantized_activations(x)
    activations = dequantized_activations(xq, xd, cols).astype(np.float64)
    out = np.full((tokens, rows), np.nan, np.float32)
    matmul_groups(repack(stored, qtype, rows, cols), int(form), cols, xq, xd, xsum, tokens, out, 0,
                  rows // 8, False, np.zeros((8, 8), np.float32), *UNTILED)
    expected = activations @ converted.T.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    against_stored = activations @ exact_weights.T.astype(np.float64)
    np.testing.assert_allclose(out, against_stored, rtol=0, atol=5e-3 * np.abs(against_stored).max())


def test_a_q5_k_matrix_whose_scales_overflow_fp16_stays_on_the_float_path():
    from decoding.kernels.forward import _packed
    from decoding.kernels.repack import q5_k_as_q5_1
    from decoding.model.weights import WeightMatrix

    rng = np.random.default_rng(5)
    stored = store_as(rng.standard_normal((8, 256)).astype(np.float32), QType.Q5_K, rng)
    stored[:, 0:2] = np.float16(60000.0).reshape(1, 1).view(np.uint8)  # d: times a 6-bit scale, past fp16
    stored[:, 4:16] = 63  # every scale at its largest
    with pytest.raises(ValueError, match="fp16"):
        q5_k_as_q5_1(stored, 256)
    assert _packed(WeightMatrix(QType.Q5_K, 8, 256, stored), fast=True).shape[0] == 0


@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_q6_k_runs_in_7_bits_with_a_scale_per_16_weights_rounded_to_fp16(tokens):
    from decoding.model.quant import dequantize_q6_k_codes

    rng = np.random.default_rng(60 + tokens)
    rows, cols = 48, 512
    stored = store_as(rng.standard_normal((rows, cols)).astype(np.float32) / 20, QType.Q6_K, rng)
    super_blocks = stored.reshape(-1, 210)
    d = super_blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    half_scales = (d * super_blocks[:, 192:208].view(np.int8).astype(np.float32)).astype(np.float16)
    form = (dequantize_q6_k_codes(super_blocks).reshape(-1, 16, 16) * half_scales[..., None].astype(np.float32))
    form = form.reshape(rows, cols)  # what the kernel multiplies: d·scale rounded to fp16, times q6 − 32
    exact_weights = dequantize(stored, QType.Q6_K, cols)
    np.testing.assert_allclose(form, exact_weights, rtol=0, atol=1e-3 * np.abs(exact_weights).max())
    x = rng.standard_normal((tokens, cols)).astype(np.float32) * 3
    xq, xd, xsum = quantized_activations(x)
    activations = dequantized_activations(xq, xd, cols).astype(np.float64)
    out = np.full((tokens, rows), np.nan, np.float32)
    packed = repack(stored, QType.Q6_K, rows, cols)
    assert packed.nbytes == rows * cols * 7 // 8  # 6 bits a weight and a fp16 scale per 16
    matmul_groups(packed, int(QType.Q6_K), cols, xq, xd, xsum, tokens, out, 0,
                  rows // 8, False, np.zeros((8, 8), np.float32), *UNTILED)
    expected = activations @ form.T.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


_EXTREMES_SCRIPT = """
import sys, numpy as np
from tests.test_fast_kernels import extreme_products
np.save(sys.argv[1], extreme_products())
"""


def extreme_products() -> np.ndarray:
    """Every int8 kernel on the operands nearest saturation: each type's largest stored byte against
    activations of ±127 (and random ones), as float32 results stacked."""
    rng = np.random.default_rng(11)
    rows, cols, results = 16, 256, []
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q6_K):
        for weights in (np.full((rows, cols), 3.0, np.float32), rng.standard_normal((rows, cols)).astype(np.float32)):
            stored = store_as(weights, qtype, rng)
            for x in (np.full((4, cols), 127.0, np.float32), -np.full((4, cols), 127.0, np.float32),
                      rng.standard_normal((4, cols)).astype(np.float32) * 50):  # fmt: skip
                xq, xd, xsum = quantized_activations(x)
                out = np.zeros((4, rows), np.float32)
                matmul_groups(repack(stored, qtype, rows, cols), int(qtype), cols, xq, xd, xsum, 4, out, 0, rows // 8,
                              False, np.zeros((8, 8), np.float32), *UNTILED)  # fmt: skip
                results.append(out)
    return np.stack(results)


def test_the_vnni_avx2_and_plain_ir_dot_products_give_the_same_bits(tmp_path):
    """vpdpbusd, AVX2's vpmaddubsw/vpmaddwd and plain vector IR compute the same integers, so a model's
    output does not depend on which of them the CPU runs. This process runs the best its CPU has; a
    second one, with a fresh kernel cache, the plain IR."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "plain.npy"
    env = {**os.environ, "TREADLE_NO_VNNI": "1", "TREADLE_NO_AVX2": "1", "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", _EXTREMES_SCRIPT, str(out)], check=True, env=env, timeout=600,
                   cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    np.testing.assert_array_equal(extreme_products(), np.load(out))


def test_the_tiles_copy_of_any_split_of_rows_is_the_copy_row_by_row():
    """Threads quantize ranges of rows that need not start or end on a tile: whole tiles are copied at once,
    the rows of a shared tile one at a time, and every range's copy lands where the row-by-row copy puts it."""
    from decoding.kernels.amx import EMULATED, tile_activation_row, tile_activation_rows

    rng = np.random.default_rng(11)
    tokens, cols = 70, 320
    xq, xd, xsum = quantized_activations(rng.standard_normal((tokens, cols)).astype(np.float32))
    n_tiled = 64
    one_by_one = tile_activations(EMULATED, tokens, cols)
    for t in range(n_tiled):
        tile_activation_row(one_by_one, t, cols, xq[t], xd[t], xsum[t])
    for bounds in ([0, 70], [0, 35, 70], [0, 7, 16, 17, 40, 48, 63, 66, 70], [0, 32, 64, 70]):
        copied = tile_activations(EMULATED, tokens, cols)
        for begin, end in itertools.pairwise(bounds):
            tile_activation_rows(copied, begin, end, n_tiled, cols, xq, xd, xsum)
        for name, expected, got in zip(one_by_one._fields[2:], one_by_one[2:], copied[2:], strict=True):
            np.testing.assert_array_equal(got, expected, err_msg=f"{name} after the ranges {bounds}")
