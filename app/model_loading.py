"""The served model as `treadle serve` (and each Ray replica) loads it: the file or directory named by
`--model`, with `--chat-template`'s template in place of its own when one is given."""

from __future__ import annotations

import logging
from pathlib import Path

from decoding import Model, ModelLoadError, TemplateError
from decoding.model.encoder import EncoderModel
from decoding.model.registry import load_any_model
from decoding.model.tokenizer import Tokenizer

from .settings import ServerSettings


def load_served_model(settings: ServerSettings) -> Model | EncoderModel:
    """ModelLoadError says why the model (or the template file) cannot be served."""
    model = load_any_model(settings.model)
    if isinstance(model, EncoderModel):
        if settings.chat_template is not None:
            raise ModelLoadError(f"--chat-template: {model.name} is an encoder (it embeds or scores text) and "
                                 "renders no chat")
        return model
    if settings.chat_template is not None:
        use_chat_template_file(model.tokenizer, settings.chat_template)
    return model


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
