import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from decoding import ModelLoadError, load_model
from decoding.kernels.reference import forward_logits
from decoding.model.quant import QType
from decoding.model.weights import release_mapped_pages
from tests.tinymodel import TinyShape, write_gguf, write_hf_directory


def test_default_model_hyperparameters_come_from_the_gguf(default_model):
    cfg = default_model.config
    assert ((cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
            == (30, 576, 1536, 9, 3, 64))
    assert cfg.vocab_size == 49152 and cfg.max_context == 8192
    assert cfg.rope_theta == 100000.0 and abs(cfg.rms_eps - 1e-5) < 1e-9
    assert cfg.tied_embeddings and default_model.weights.lm_head is default_model.weights.token_embedding
    assert cfg.eos_token_ids == (2,) and cfg.add_bos_token is False


def test_default_model_weights_stay_quantized_and_memory_mapped(default_model):
    layer = default_model.weights.layers[0]
    assert layer.wq.qtype == QType.Q4_1 and layer.wq.data.dtype == np.uint8
    assert default_model.weights.token_embedding.qtype == QType.Q8_0
    base = layer.wq.data
    while getattr(base, "base", None) is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap), "weights must be views of the file's memory map, not copies"
    assert 90e6 < default_model.weights.nbytes < 110e6


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_released_weight_pages_leave_the_rss_and_read_back_unchanged(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", TinyShape(dim=256, hidden_dim=1024), seed=3)
    matrix = load_model(path).weights.layers[0].w_gate.data  # 1 MiB of float32
    copy = np.array(matrix)  # reads (faults in) every page
    resident = _resident_kib(path)
    assert release_mapped_pages(matrix)
    assert _resident_kib(path) <= resident - matrix.nbytes // 1024 + 8  # at most its two edge pages stay
    np.testing.assert_array_equal(matrix, copy)  # faulted back from the page cache


def test_release_refuses_memory_that_is_not_a_read_only_file_map(tmp_path):
    anonymous = np.arange(1 << 16, dtype=np.uint8)
    assert not release_mapped_pages(anonymous)
    assert anonymous[12345] == 12345 % 256
    writable = np.memmap(tmp_path / "rw.bin", dtype=np.uint8, mode="w+", shape=(1 << 16,))
    writable[:] = 7
    assert not release_mapped_pages(writable)
    assert (writable == 7).all()


def test_gguf_and_safetensors_of_the_same_weights_give_the_same_logits(tmp_path):
    """The GGUF's permuted Q/K rows with adjacent-pair RoPE and the checkpoint's own rows with
    rotate-half RoPE are the same rotation: equal up to the order of float sums."""
    shape = TinyShape(n_layers=2, dim=64, n_heads=4, n_kv_heads=2)
    gguf_model = load_model(write_gguf(tmp_path / "tiny.gguf", shape, seed=5))
    hf_model = load_model(write_hf_directory(tmp_path / "hf", shape, seed=5))
    ids = gguf_model.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    assert ids == hf_model.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    assert not gguf_model.config.rope_neox and hf_model.config.rope_neox
    np.testing.assert_allclose(forward_logits(gguf_model, ids), forward_logits(hf_model, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_safetensors_load_as_stored(tmp_path, dtype):
    model = load_model(write_hf_directory(tmp_path / dtype, seed=1, dtype=dtype))
    assert model.weights.layers[0].wq.qtype == QType[dtype]
    reference = load_model(write_hf_directory(tmp_path / "f32", seed=1))
    ids = [5, 80, 120, 7, 33]
    np.testing.assert_allclose(forward_logits(model, ids), forward_logits(reference, ids), atol=0.05)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16, QType.BF16])
def test_quantized_gguf_types_load_in_their_stored_form(tmp_path, qtype):
    model = load_model(write_gguf(tmp_path / f"{qtype.name}.gguf", qtype=qtype, seed=2))
    assert model.weights.layers[1].w_down.qtype == qtype
    reference = load_model(write_gguf(tmp_path / "f32.gguf", seed=2))
    ids = [10, 20, 30, 40]
    tolerance = {QType.Q4_0: 1.5, QType.Q4_1: 1.0}.get(qtype, 0.1)
    np.testing.assert_allclose(forward_logits(model, ids), forward_logits(reference, ids), atol=tolerance)


def test_other_ggml_types_are_dequantized_at_load_with_a_notice(tmp_path, caplog):
    import gguf

    mxfp4 = _rewrite_ffn_up(write_gguf(tmp_path / "f32.gguf", seed=3), tmp_path / "mxfp4.gguf",
                            gguf.GGMLQuantizationType.MXFP4)
    with caplog.at_level("WARNING"):
        model = load_model(mxfp4)
    assert model.weights.layers[0].w_up.qtype == QType.F32
    assert any("MXFP4" in r.getMessage() for r in caplog.records)
    reference = load_model(tmp_path / "f32.gguf")
    np.testing.assert_allclose(model.weights.layers[0].w_up.dequantize(),
                               reference.weights.layers[0].w_up.dequantize(), atol=0.1)


def test_5_bit_and_k_types_stay_as_stored(tmp_path, caplog):
    import gguf

    q5 = _rewrite_ffn_up(write_gguf(tmp_path / "f32.gguf", seed=3), tmp_path / "q5_1.gguf",
                         gguf.GGMLQuantizationType.Q5_1)
    with caplog.at_level("WARNING"):
        model = load_model(q5)
    assert model.weights.layers[0].w_up.qtype == QType.Q5_1 and not caplog.records
    reference = load_model(tmp_path / "f32.gguf")
    np.testing.assert_allclose(model.weights.layers[0].w_up.dequantize(),
                               reference.weights.layers[0].w_up.dequantize(), atol=0.05)
    k_model = load_model(write_gguf(tmp_path / "q4_k.gguf", TinyShape(dim=256, hidden_dim=512), qtype=QType.Q4_K))
    assert k_model.weights.storage_types() == {"Q4_K": 2 * 7 + 1}  # every layer matrix and the tied embedding


def _rewrite_ffn_up(src: Path, dst: Path, raw_type) -> Path:  # type: ignore[no-untyped-def]
    """A copy of `src` with blk.0.ffn_up stored as `raw_type` (quantized by the gguf package)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.ffn_up.weight":
            dense = data.reshape(int(t.shape[1]), int(t.shape[0]))
            writer.add_tensor(t.name, gguf.quants.quantize(dense, raw_type), raw_dtype=raw_type)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_truncated_gguf_is_refused_with_its_name(tmp_path, tiny_gguf):
    truncated = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    truncated.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(truncated)


def test_garbage_and_empty_files_are_refused(tmp_path):
    for name, content in (("empty.gguf", b""), ("text.gguf", b"not a model at all\n" * 10)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError):
            load_model(tmp_path / name)


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported architecture 'phi3'"):
        load_model(write_gguf(tmp_path / "q.gguf", architecture="phi3"))


def test_an_architecture_tensor_missing_from_the_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="lacks tensor 'blk.0.attn_q.bias'"):  # qwen2 has Q, K, V biases
        load_model(write_gguf(tmp_path / "q.gguf", architecture="qwen2"))


def test_unknown_model_name_is_refused():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_hf_directory_with_missing_tensor_is_refused(tmp_path):
    directory = write_hf_directory(tmp_path / "hf")
    (directory / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ModelLoadError):
        load_model(directory)


@pytest.mark.parametrize("model_arg", ["no-such-model", "TRUNCATED"])
def test_cli_prints_one_line_and_exits_2_for_a_bad_model(tmp_path, tiny_gguf, model_arg):
    if model_arg == "TRUNCATED":
        model_arg = str(tmp_path / "cut.gguf")
        Path(model_arg).write_bytes(tiny_gguf.read_bytes()[:4000])
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", model_arg, "hello"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treadle: error:"), result.stderr
    assert "Traceback" not in result.stderr


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def test_the_architecture_is_read_from_the_header_as_gguf_reads_it(tmp_path):
    """Keys before `general.architecture` (a string array, numbers, a nested array) are skipped by their
    sizes; gguf-py's full reader is the oracle. A truncated or foreign file has no architecture."""
    import gguf

    from decoding.model.gguf_loader import gguf_architecture

    kvs = [
        _gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3)
        + b"".join(map(_gguf_string, ["a", "bc", "é"])),
        _gguf_string("some.count") + struct.pack("<IQ", 10, 7),
        _gguf_string("some.scores") + struct.pack("<IIQ", 9, 6, 2) + struct.pack("<2f", 0.5, -1.0),
        _gguf_string("nested") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 7, 2) + b"\x01\x00",
        _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("qwen3moe"),
    ]  # fmt: skip
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    path = tmp_path / "late.gguf"
    path.write_bytes(header + b"".join(kvs))
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "qwen3moe"
    assert gguf_architecture(path) == "qwen3moe"

    path.write_bytes(header + b"".join(kvs)[:-5])
    assert gguf_architecture(path) is None
    path.write_bytes(b"PK\x03\x04 not a gguf")
    assert gguf_architecture(path) is None


def test_the_loaders_reader_gives_gguf_pys_fields_whole_and_by_index(tmp_path, tiny_gguf):
    """gguf_reader reads arrays in one pass (a real vocabulary took ~2 s of every start through gguf-py's
    per-element parsing): every field's types and contents, whole and element by element, are gguf-py's."""
    import gguf

    from decoding.model.gguf_loader import gguf_reader

    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "é", "a b", "\u2028", "x" * 300])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_key_value("test.floats", [0.5, -2.25], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    writer.add_key_value("test.bytes", [0, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    writer.add_array("test.empty", [])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.scalar", 9)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for file in (path, tiny_gguf):
        ours, theirs = gguf_reader(file), gguf.GGUFReader(file)
        assert list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            mine = ours.fields[name]
            assert (mine.types, mine.contents()) == (field.types, field.contents()), name
            for index in range(len(field.data) if field.types[0] == gguf.GGUFValueType.ARRAY else 0):
                assert mine.contents(index) == field.contents(index), (name, index)
        assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


@pytest.mark.parametrize("weight_cache", [False, True], ids=["repacked-in-memory", "mapped-from-the-weight-cache"])
def test_a_built_fast_model_keeps_none_of_its_file_resident(tmp_path, weight_cache):
    """The fast kernels read only their repacked copy; the norms and biases are copied out of the file. Reading
    those small tensors at load faults in the file pages around them (a whole large page-cache folio each where
    the kernel has them: 120 MiB of the 7B shape's file), which must not stay in the process's RSS."""
    from decoding.kernels.forward import KernelWeights

    path = write_gguf(tmp_path / "tiny.gguf", TinyShape(dim=256, hidden_dim=1024), qtype=QType.Q8_0, seed=4)
    cache = tmp_path / "tiny.packed" if weight_cache else None
    if cache is not None:
        first = load_model(path)
        KernelWeights.build(first.config, first.weights, fast=True, cache=cache)
        assert cache.exists()
    model = load_model(path)
    before = np.array(model.weights.layers[0].attn_norm)  # the map is read: its pages are resident
    assert _resident_kib(path) > 0
    built = KernelWeights.build(model.config, model.weights, fast=True, cache=cache)
    assert _resident_kib(path) == 0
    np.testing.assert_array_equal(built.arrays.norms[0, 0], before)
    ids = np.array([3, 1, 3], dtype=np.int64)
    embedding = np.asarray(model.weights.token_embedding.data).view(np.uint8).reshape(model.config.vocab_size, -1)
    np.testing.assert_array_equal(built.token_rows.gather(ids), embedding[ids])  # rows still read from the file
