"""A generation model served as a reranker (`treadle serve --task rerank`), as Qwen3-Reranker is run.

The (query, document) pair is rendered into the model's judging prompt, which ends where the assistant
answers; the answer's first token is "yes" or "no", and the score is p(yes) of the softmax over those two
logits of the last position (sigmoid(yes - no)): the LM head's two rows, nothing else of it. From a Hugging
Face directory the rows are the head's (or the tied embedding's) rows of the tokens "yes" and "no" and the
prompt is the model card's. From a GGUF as llama.cpp's converter writes a reranker (`pooling_type` 4,
rank) the rows are `cls.output.weight` (yes, no) and the prompt `tokenizer.chat_template.rerank`, with
`{query}` and `{document}` where the pair goes.
"""

from __future__ import annotations

import numpy as np

from .decoder_embedder import DecoderEmbedder, DecoderEmbeddingTokenizer
from .encoder import EncoderConfig
from .errors import ModelLoadError
from .gguf_loader import read_rerank_head
from .model import Model

# Qwen3-Reranker's model card, with its default instruction (as llama.cpp's converter writes it)
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a "
    "web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def is_reranker(model: Model) -> bool:
    """The file says it is a reranker: a GGUF's rank pooling, or a directory whose README or name is
    Qwen3-Reranker's (the hints llama.cpp's converter reads)."""
    if model.config.pooling == "rank":
        return True
    path = model.path
    if not path.is_dir():
        return False
    readme = path / "README.md"
    text = readme.read_text(encoding="utf-8", errors="replace").lower() if readme.is_file() else ""
    return "# qwen3-reranker" in text or "qwen3-reranker" in path.name.lower()


def decoder_reranker(model: Model, max_context: int) -> DecoderEmbedder:
    """`model` as a reranker: one score in [0, 1] per (query, document) input."""
    if model.config.is_moe:
        raise ModelLoadError(f"{model.name}: a mixture of experts is not served as a reranker")
    template, rows = read_rerank_head(model.path) if model.path.is_file() else (None, None)
    if rows is None:
        rows = _yes_no_rows(model)
    mc = model.config
    if rows.shape != (2, mc.dim):
        raise ModelLoadError(f"{model.name}: the rerank head has shape {rows.shape}, expected (2, {mc.dim})")
    cfg = EncoderConfig(
        n_layers=mc.n_layers, dim=mc.dim, hidden_dim=mc.hidden_dim, n_heads=mc.n_heads, vocab_size=mc.vocab_size,
        max_positions=mc.max_context, max_context=min(max_context, mc.max_context), n_token_types=1,
        norm_eps=mc.rms_eps, task="classify", pooling="last", n_labels=1, sigmoid=True,
        architecture=mc.architecture, name=model.name,
    )  # fmt: skip
    tokenizer = DecoderEmbeddingTokenizer(model.tokenizer, add_eos=False,
                                          pair_template=template or QWEN3_RERANK_TEMPLATE)
    return DecoderEmbedder(cfg, model, tokenizer, model.path, model.name, score_rows=rows)


def _yes_no_rows(model: Model) -> np.ndarray:
    backend = model.tokenizer.backend
    ids = [backend.token_to_id(word) for word in ("yes", "no")]
    if None in ids:
        raise ModelLoadError(f"{model.name}: its vocabulary has no single tokens \"yes\" and \"no\", which a "
                             "reranker's answer is read from")
    return np.ascontiguousarray(model.weights.lm_head.dequantize_rows(np.array(ids)), dtype=np.float32)

