"""decoding: models (loading, tokenizer, templates), kernels, the forward step, sampling and the engine."""

from threadpool.numba_cache import use_numba_cache

use_numba_cache()  # before any kernel of the package is compiled: threadpool/numba_cache.py says why

from .model.config import ModelConfig  # noqa: E402
from .model.errors import ModelLoadError, TemplateError  # noqa: E402
from .model.model import Model  # noqa: E402
from .model.registry import DEFAULT_MODEL, load_model  # noqa: E402

__all__ = ["DEFAULT_MODEL", "Model", "ModelConfig", "ModelLoadError", "TemplateError", "load_model"]
