"""The retrieval APIs' request schemas and response shapes: OpenAI's embeddings, the rerank shape
(Jina's and Cohere's, as llama-server and vLLM answer it), vLLM's score, and Ollama's embed.

Inputs become (token ids, token types) for the encoder here; the routes (app/embedding_routes.py) submit
them and shape what comes back.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, model_validator

from decoding.model.encoder import EncoderTokenizer

from .errors import APIError
from .schema_base import NonEmptyStr, StrictBody, one_of

TokenIdList = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
EmbeddingInput = Annotated[
    NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIdList
    | Annotated[list[TokenIdList], Field(min_length=1)],
    one_of("must be a non-empty string, a list of non-empty strings, a list of token ids or a list of lists of them"),
]
# vLLM's truncate_prompt_tokens: keep this many tokens of each input (-1: the model's context); None: refuse
# inputs longer than the context
Truncate = Annotated[int, Field(ge=-1)]


class EmbeddingsRequest(StrictBody):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    truncate_prompt_tokens: Truncate | None = None
    user: str | None = None


class RerankDocument(StrictBody):
    text: NonEmptyStr


class RerankRequest(StrictBody):
    model: str | None = None
    query: NonEmptyStr
    documents: Annotated[list[NonEmptyStr | RerankDocument], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Truncate | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


TextOrTexts = Annotated[NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)],
                        one_of("must be a non-empty string or a non-empty list of them")]


class ScoreRequest(StrictBody):
    """vLLM's /v1/score: text_1 against each of text_2 (one to many), or pairwise (two lists of one length)."""

    model: str | None = None
    text_1: TextOrTexts
    text_2: TextOrTexts
    truncate_prompt_tokens: Truncate | None = None

    @model_validator(mode="after")
    def _pairs_match(self) -> ScoreRequest:
        if isinstance(self.text_1, list) and isinstance(self.text_2, list) and len(self.text_1) not in (
                1, len(self.text_2)):
            raise ValueError(f"text_1 has {len(self.text_1)} texts and text_2 {len(self.text_2)}: give one text_1, "
                             "or as many as text_2")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        firsts = self.text_1 if isinstance(self.text_1, list) else [self.text_1]
        seconds = self.text_2 if isinstance(self.text_2, list) else [self.text_2]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return list(zip(firsts, seconds, strict=True))


class OllamaEmbedRequest(StrictBody):
    model: str | None = None
    input: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaLegacyEmbeddingRequest(StrictBody):
    model: str | None = None
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class InputPreparer:
    """Texts (or token ids) → (token ids, token types) within the model's context: truncated where the
    request asks, else refused with a 400 naming the input."""

    def __init__(self, tokenizer: EncoderTokenizer, max_tokens: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        # special tokens before and after a text ([CLS] and [SEP] for BERT): kept when a text is cut
        mask = tokenizer.special_tokens_mask("a")
        self.num_head = next((i for i, special in enumerate(mask) if not special), len(mask))
        self.num_tail = next((i for i, special in enumerate(reversed(mask)) if not special), 0)

    def limit(self, truncate: int | None) -> int | None:
        """The tokens an input may keep; None: refuse longer inputs."""
        if truncate is None:
            return None
        if truncate == -1:
            return self.max_tokens
        if truncate > self.max_tokens:
            raise APIError(400, f"truncate_prompt_tokens {truncate} exceeds the model's context of {self.max_tokens} "
                                "tokens", "truncate_prompt_tokens", code="invalid_value")
        if truncate <= self.num_head + self.num_tail:
            raise APIError(400, f"truncate_prompt_tokens {truncate} leaves no room for text beside the "
                                f"{self.num_head + self.num_tail} special tokens", "truncate_prompt_tokens",
                           code="invalid_value")  # fmt: skip
        return truncate

    def texts(self, texts: list[str], limit: int | None, param: str = "input") -> list[tuple[list[int], list[int]]]:
        encoded = self.tokenizer.encode_batch(texts)
        return [self._fit(ids, types, limit, f"{param}[{i}]" if len(texts) > 1 else param)
                for i, (ids, types) in enumerate(encoded)]  # fmt: skip

    def pairs(self, pairs: list[tuple[str, str]], limit: int | None, param: str) -> list[tuple[list[int], list[int]]]:
        encoded = [self.tokenizer.encode_pair(a, b, limit) for a, b in pairs]
        return [self._fit(ids, types, limit, f"{param}[{i}]") for i, (ids, types) in enumerate(encoded)]

    def token_ids(self, lists: list[list[int]], limit: int | None) -> list[tuple[list[int], list[int]]]:
        out = []
        for i, ids in enumerate(lists):
            param = f"input[{i}]" if len(lists) > 1 else "input"
            if max(ids) >= self.vocab_size:
                raise APIError(400, f"{param}: token id {max(ids)} is outside the vocabulary of {self.vocab_size}",
                               param, code="invalid_value")
            if limit is not None and len(ids) > limit:
                ids = ids[:limit]  # ids are embedded as given: no special tokens to keep
            out.append(self._fit(list(ids), [0] * len(ids), None, param))
        return out

    def _fit(self, ids: list[int], types: list[int], limit: int | None, param: str) -> tuple[list[int], list[int]]:
        if limit is not None and len(ids) > limit:
            keep = limit - self.num_tail
            ids = ids[:keep] + ids[len(ids) - self.num_tail :]
            types = types[:keep] + types[len(types) - self.num_tail :]
        if len(ids) > self.max_tokens:
            raise APIError(400, f"{param} has {len(ids)} tokens; the model takes at most {self.max_tokens} (send "
                                "truncate_prompt_tokens to cut longer inputs)", param, code="context_length_exceeded")
        return ids, types


def embedding_data(vectors: np.ndarray, encoding_format: str) -> list[dict[str, Any]]:
    data = []
    for i, vector in enumerate(vectors):
        if encoding_format == "base64":  # float32 little-endian bytes, as OpenAI sends (and its client decodes)
            value: Any = base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return data


def cut_dimensions(vectors: np.ndarray, dimensions: int | None, matryoshka: tuple[int, ...], normalize: bool,
                   param: str = "dimensions") -> np.ndarray:  # fmt: skip
    """The first `dimensions` of each vector (renormalised where the model normalises), for a model
    trained to be cut (Matryoshka); the full size is always accepted, any other refused."""
    full = vectors.shape[1]
    if dimensions is None or dimensions == full:
        return vectors
    if not matryoshka:
        raise APIError(400, f"{param}: this model's embeddings have {full} dimensions and it was not trained to "
                            "be cut shorter (no Matryoshka dimensions declared)", param, code="unsupported_parameter")
    if dimensions > full:
        raise APIError(400, f"{param} {dimensions} exceeds the model's {full}", param, code="invalid_value")
    cut = vectors[:, :dimensions].copy()
    if normalize:
        cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
