"""A generation model served as an embedder or reranker: its tokenizer as an embedder uses it, and the
model with the pooling its embeddings are read by."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .encoder import EncoderConfig, EncoderWeights
from .errors import ModelLoadError
from .model import Model
from .tokenizer import Tokenizer


class DecoderEmbeddingTokenizer:
    """A generation model's tokenizer as an embedder uses it: the tokenizer's own special tokens (BOS where
    the model adds one), and EOS at the end where the model asks for it (`add_eos_token`: an embedder
    pooling the last token reads that token's state, as Qwen3-Embedding does). A reranker's tokenizer
    renders a (query, document) pair into its `pair_template` (`{query}`, `{document}`) as one input."""

    def __init__(self, tokenizer: Tokenizer, add_eos: bool, pair_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_ids[0] if add_eos and tokenizer.eos_token_ids else None
        self.vocab_size = tokenizer.vocab_size
        self.pair_template = pair_template

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        # tokenizer.json's own post-processor first (a sentence-transformers directory's: Qwen3-Embedding's
        # appends EOS there), then what a GGUF's flags ask for and the post-processor did not add
        tokenizer = self.tokenizer
        ids = tokenizer.backend.encode(text, add_special_tokens=True).ids
        if tokenizer.add_bos_token and (not ids or ids[0] != tokenizer.bos_token_id):
            ids.insert(0, tokenizer.bos_token_id)
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
        return ids, [0] * len(ids)

    def encode_pair(self, first: str, second: str, max_tokens: int | None = None) -> tuple[list[int], list[int]]:
        """A reranker's input for (query, document): the template rendered with both, special tokens as
        tokens. With `max_tokens`, the document is cut (at a token, from its end) until the input fits:
        the template's tail is what the score is read after, so it is never the part cut."""
        if self.pair_template is None:
            raise ModelLoadError("a decoder embedder scores pairs by the cosine of their embeddings, not as one input")
        ids = self._render(first, second)
        if max_tokens is not None and len(ids) > max_tokens:
            document = self.tokenizer.backend.encode(second, add_special_tokens=False).ids
            keep = len(document) - (len(ids) - max_tokens)
            while keep > 0 and len(ids := self._render(first, self.tokenizer.decode(document[:keep]))) > max_tokens:
                keep -= 1
            if keep <= 0:
                ids = self._render(first, "")
        return ids, [0] * len(ids)

    def _render(self, query: str, document: str) -> list[int]:
        text = self.pair_template.replace("{query}", query).replace("{document}", document)  # type: ignore[union-attr]
        return self.tokenizer.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        return [self.encode(text) for text in texts]

    def special_tokens_mask(self, text: str) -> list[int]:
        plain = self.tokenizer.backend.encode(text, add_special_tokens=False).ids
        ids, _ = self.encode(text)
        head = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), 0)
        return [1] * head + [0] * len(plain) + [1] * (len(ids) - len(plain) - head)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass(eq=False)
class DecoderEmbedder:
    """A generation model served as an embedder (`treadle serve --task embed`, or a file that declares a
    pooling): its layers over each whole input, the final-normed hidden states pooled (the last token's,
    the mean, or the first's) and L2-normalised where the model says so. `config` is the shape the
    embedding engine and routes read, with the decoder's sizes."""

    config: EncoderConfig
    decoder: Model
    tokenizer: DecoderEmbeddingTokenizer
    path: Path
    name: str
    weights: EncoderWeights | None = None  # the decoder's live in `decoder`; no BERT classifier head
    # a reranker (config.task "classify"): the rows of the LM head whose logits score a pair, "yes" then
    # "no" (Qwen3-Reranker's recipe); the score is softmax over the two, p(yes) = sigmoid(yes - no)
    score_rows: np.ndarray | None = None


def decoder_embedder(model: Model, pooling: str, normalize: bool, max_context: int) -> DecoderEmbedder:
    mc = model.config
    cfg = EncoderConfig(
        n_layers=mc.n_layers, dim=mc.dim, hidden_dim=mc.hidden_dim, n_heads=mc.n_heads, vocab_size=mc.vocab_size,
        max_positions=mc.max_context, max_context=min(max_context, mc.max_context), n_token_types=1,
        norm_eps=mc.rms_eps, task="embed", pooling=pooling, normalize=normalize, architecture=mc.architecture,
        name=model.name,
    )  # fmt: skip
    return DecoderEmbedder(cfg, model, DecoderEmbeddingTokenizer(model.tokenizer, mc.add_eos_token), model.path,
                           model.name)
