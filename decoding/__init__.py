"""decoding: models (loading, tokenizer, templates), kernels, the forward step, sampling and the engine."""

from .config import ModelConfig
from .errors import ModelLoadError, TemplateError
from .model import Model
from .registry import DEFAULT_MODEL, load_model

__all__ = ["DEFAULT_MODEL", "Model", "ModelConfig", "ModelLoadError", "TemplateError", "load_model"]
