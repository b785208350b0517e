"""decoding: models (loading, tokenizer, templates), kernels, the forward step, sampling and the engine."""

from .model.config import ModelConfig
from .model.errors import ModelLoadError, TemplateError
from .model.model import Model
from .model.registry import DEFAULT_MODEL, load_model

__all__ = ["DEFAULT_MODEL", "Model", "ModelConfig", "ModelLoadError", "TemplateError", "load_model"]
