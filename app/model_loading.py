"""The served model as `treadle serve` (and each Ray replica) loads it: the file or directory named by
`--model`, with `--chat-template`'s template in place of its own when one is given."""

from __future__ import annotations

import logging
from pathlib import Path

from decoding import Model, ModelLoadError, TemplateError
from decoding.model.decoder_embedder import DecoderEmbedder, decoder_embedder
from decoding.model.decoder_reranker import decoder_reranker, is_reranker
from decoding.model.encoder import EncoderModel, sentence_transformers_pooling
from decoding.model.registry import load_any_model
from decoding.model.tokenizer import Tokenizer

from .settings import ServerSettings

# a decoder embedder's inputs are computed whole in one step: this bounds them unless --max-model-len says more
DECODER_EMBEDDING_CONTEXT = 8192


def load_served_model(settings: ServerSettings) -> Model | EncoderModel | DecoderEmbedder:
    """ModelLoadError says why the model (or the template file) cannot be served."""
    model = load_any_model(settings.model)
    if isinstance(model, EncoderModel):
        if "generate" in settings.task:
            raise ModelLoadError(f"--task {settings.task}: {model.name} is an encoder (it embeds or scores text) "
                                 "and generates nothing")
        if settings.chat_template is not None:
            raise ModelLoadError(f"--chat-template: {model.name} is an encoder (it embeds or scores text) and "
                                 "renders no chat")
        wanted = {"embed": "embed", "rerank": "classify"}.get(settings.task, model.config.task)
        if wanted != model.config.task:
            does = "embeds texts" if model.config.task == "embed" else "scores text pairs (a cross-encoder)"
            raise ModelLoadError(f"--task {settings.task}: {model.name} {does}")
        return model
    if settings.task == "rerank" or (settings.task == "auto" and is_reranker(model)):
        if settings.chat_template is not None:
            raise ModelLoadError("--chat-template: a reranker renders its own judging prompt, not a chat")
        context = settings.engine.max_model_len or DECODER_EMBEDDING_CONTEXT
        logging.getLogger("treadle").info("%s reranks: p(yes) of its answer to the judging prompt, inputs up to %d "
                                          "tokens", model.name, min(context, model.config.max_context))
        return decoder_reranker(model, context)
    if settings.task == "embed" or (settings.task == "auto" and model.config.pooling):
        return embedder_of(model, settings)
    if settings.chat_template is not None:
        use_chat_template_file(model.tokenizer, settings.chat_template)
    return model


def embedder_of(model: Model, settings: ServerSettings) -> DecoderEmbedder:
    """A generation model as an embedder: `--pooling` or what the file declares (else the last token's),
    L2-normalised unless a sentence-transformers directory says otherwise."""
    declared = model.config.pooling
    pooling = settings.pooling if settings.pooling != "auto" else declared or "last"
    normalize = True  # as llama-server's embeddings are by default; a sentence-transformers directory says
    modules = sentence_transformers_pooling(model.path) if model.path.is_dir() else None
    if modules is not None:
        normalize = modules[1]
    # whole inputs in one step on an embedding server; split over steps beside generation, like prompts
    context = settings.engine.max_model_len or (
        model.config.max_context if settings.task == "generate,embed" else DECODER_EMBEDDING_CONTEXT)
    logging.getLogger("treadle").info("%s embeds: %s pooling%s, inputs up to %d tokens", model.name, pooling,
                                      ", L2-normalised" if normalize else "", min(context, model.config.max_context))
    return decoder_embedder(model, pooling, normalize, context)


def use_chat_template_file(tokenizer: Tokenizer, path: str) -> None:
    """--chat-template: the file's template replaces the model's, or ModelLoadError says why it cannot."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"--chat-template {path}: cannot read it ({exc})") from None
    try:
        tokenizer.use_chat_template(source)
    except TemplateError as exc:
        raise ModelLoadError(f"--chat-template {path}: the template does not render a sample conversation: "
                             f"{exc}") from None
    logging.getLogger("treadle").info("chat template: %s (--chat-template)", path)
