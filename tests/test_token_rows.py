"""A step's token-embedding rows, read from the model file: the same bytes, none of the map's pages."""

import struct

import numpy as np
import pytest

from decoding import load_model
from decoding.kernels.forward import KernelWeights
from decoding.model.quant import QType
from decoding.model.token_rows import TokenRows
from tests.tinymodel import TinyShape, write_gguf

PAGE = 4096


def mapped_pages(array: np.ndarray) -> int:
    """Pages of `array` this process has mapped in (/proc/self/pagemap's present bit)."""
    first, last = array.ctypes.data // PAGE, (array.ctypes.data + array.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", entries))


@pytest.fixture(scope="module")
def wide_embedding(tmp_path_factory):
    """A model whose embedding rows are a page each (1,024 float32 values)."""
    shape = TinyShape(n_layers=1, dim=1024, hidden_dim=128, n_heads=8, n_kv_heads=4)
    return load_model(write_gguf(tmp_path_factory.mktemp("m") / "wide.gguf", shape, qtype=QType.Q8_0, seed=2))


def test_rows_read_from_the_file_are_the_stored_rows_and_map_none_of_its_pages(wide_embedding):
    embedding = KernelWeights.build(wide_embedding.config, wide_embedding.weights, fast=False).token_rows.embedding
    rows = TokenRows(embedding)
    assert rows.reads_file
    ids = np.random.default_rng(0).permutation(embedding.shape[0]).astype(np.int32)
    before = mapped_pages(embedding)
    got = rows.gather(ids)
    assert mapped_pages(embedding) == before
    # the same rows through the map: every page comes in (the measurement can see it)
    looked_up = embedding[ids]
    assert mapped_pages(embedding) >= embedding.nbytes // PAGE - 1 > before
    assert np.array_equal(got, looked_up)
    assert np.array_equal(rows.gather(ids[:3]), looked_up[:3])  # the buffer is reused for a smaller step
    with pytest.raises(IndexError, match="outside the vocabulary"):
        rows.gather(np.array([embedding.shape[0]], dtype=np.int32))
    rows.close()
    assert not rows.reads_file  # closed: never a read through a descriptor number another file may now hold
    assert np.array_equal(rows.gather(ids[:5]), looked_up[:5])


def test_an_embedding_in_memory_is_indexed_there():
    embedding = np.arange(24, dtype=np.uint8).reshape(6, 4)
    rows = TokenRows(embedding)
    assert not rows.reads_file
    assert np.array_equal(rows.gather(np.array([5, 0, 5], dtype=np.int32)), embedding[[5, 0, 5]])
    with pytest.raises(ValueError, match="C-contiguous"):
        TokenRows(np.zeros((4, 6), dtype=np.float32))
