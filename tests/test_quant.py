import gguf
import numpy as np
import pytest

from decoding.model.quant import QType, dequantize, quantize


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
