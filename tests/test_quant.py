import gguf
import numpy as np
import pytest

from decoding.model.quant import BLOCK_SHAPES, FP16_FIELDS, QType, dequantize, quantize, row_bytes


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16, QType.BF16])
def test_dequantize_matches_the_gguf_package(qtype):
    rng = np.random.default_rng(int(qtype))
    weights = rng.standard_normal((7, 96)).astype(np.float32) * 3
    stored = gguf.quants.quantize(weights, gguf.GGMLQuantizationType(int(qtype)))
    ours = dequantize(stored, qtype, 96)
    theirs = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType(int(qtype))).reshape(7, 96)
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.BF16])
def test_quantize_matches_ggml_reference_rounding(qtype):
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((5, 64)).astype(np.float32)
    ours = quantize(weights, qtype)
    theirs = gguf.quants.quantize(weights, gguf.GGMLQuantizationType(int(qtype)))
    np.testing.assert_array_equal(ours.view(np.uint8), np.asarray(theirs).view(np.uint8))


def test_quantization_error_is_bounded_by_the_block_step():
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((4, 128)).astype(np.float32)
    for qtype, levels in ((QType.Q8_0, 127), (QType.Q4_1, 15)):
        restored = dequantize(quantize(weights, qtype), qtype, 128)
        step = np.abs(weights).max() / levels * 2
        assert np.abs(restored - weights).max() <= step


NEW_TYPES = [QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K]
def random_blocks(qtype: QType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Every bit of the quantized fields random; the fp16 scales finite, of either sign (random bytes
    there could be NaN or inf, which compare unequal)."""
    rng = np.random.default_rng(seed)
    _, size = BLOCK_SHAPES[qtype]
    data = rng.integers(0, 256, (rows, blocks_per_row, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, blocks_per_row)) * 0.05).astype(np.float16)
        data[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_dequantize_of_random_blocks_is_bit_identical_to_the_gguf_package(qtype):
    weights_per_block, _ = BLOCK_SHAPES[qtype]
    data = random_blocks(qtype, rows=6, blocks_per_row=3, seed=int(qtype))
    n_cols = 3 * weights_per_block
    ours = dequantize(data, qtype, n_cols)
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(qtype))).reshape(6, n_cols)
    assert ours.dtype == np.float32 and ours.shape == (6, n_cols)
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q5_1], ids=lambda q: q.name)
def test_q5_blocks_quantized_by_the_gguf_package_come_back_within_a_step(qtype):
    rng = np.random.default_rng(11)
    weights = rng.standard_normal((4, 128)).astype(np.float32)
    stored = gguf.quants.quantize(weights, gguf.GGMLQuantizationType(int(qtype)))
    restored = dequantize(np.asarray(stored), qtype, 128)
    assert np.abs(restored - weights).max() <= np.abs(weights).max() / 15


def test_row_bytes_of_every_block_type_follow_ggml():
    for qtype in BLOCK_SHAPES:
        ggml_weights, ggml_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qtype))]
        assert BLOCK_SHAPES[qtype] == (ggml_weights, ggml_bytes)
        assert row_bytes(qtype, 4 * ggml_weights) == 4 * ggml_bytes


@pytest.mark.slow
def test_every_tensor_of_the_real_q4_k_m_files_dequantizes_as_the_gguf_package_does(real_q4_k_m_file):
    reader = gguf.GGUFReader(real_q4_k_m_file)
    seen = set()
    for tensor in reader.tensors:
        if int(tensor.tensor_type) not in set(QType):
            continue
        qtype = QType(int(tensor.tensor_type))
        n_cols = int(tensor.shape[0])
        rows = tensor.data.reshape(-1, row_bytes(qtype, n_cols) if qtype in BLOCK_SHAPES else n_cols)
        ours = dequantize(rows, qtype, n_cols)
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(ours.shape)
        np.testing.assert_array_equal(ours, theirs.astype(np.float32), err_msg=tensor.name)
        seen.add(qtype)
    assert {QType.Q4_K, QType.Q6_K, QType.Q5_0, QType.Q8_0} <= seen  # what a Q4_K_M file mixes


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_the_kernels_row_dequantizer_equals_the_reference_bit_for_bit(qtype):
    from decoding.kernels.kernels import dequantize_row

    weights_per_block, _ = BLOCK_SHAPES[qtype]
    n_cols = 2 * weights_per_block
    data = random_blocks(qtype, rows=4, blocks_per_row=2, seed=100 + int(qtype))
    expected = dequantize(data, qtype, n_cols)
    for r in range(4):
        out = np.full(n_cols, np.nan, dtype=np.float32)
        dequantize_row(np.ascontiguousarray(data[r]), int(qtype), n_cols, out)
        np.testing.assert_array_equal(out, expected[r])
