"""Model names → files, and `load_model`: a name or a path becomes a loaded Model. The names and
where their files come from are in catalog.py."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from .catalog import DEFAULT_MODEL, KNOWN_MODELS, PackagedModel, SplitModel, resolve_known
from .encoder import EncoderModel, is_encoder_directory, load_encoder_directory, sentence_transformers_pooling
from .encoder_gguf import is_encoder_gguf, load_encoder_gguf
from .errors import ModelLoadError
from .gguf_loader import load_gguf
from .model import Model
from .safetensors_loader import load_safetensors_directory, read_config
from .tokenizer import Tokenizer
from .weights import release_freed_heap

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "PackagedModel", "SplitModel", "load_any_model", "load_model",
           "resolve_model_path"]


def resolve_model_path(name_or_path: str | Path) -> tuple[Path, str]:
    """(file or directory, display name) for a registered name, a .gguf file or a Hugging Face directory."""
    key = str(name_or_path)
    if key in KNOWN_MODELS:  # pulled by `treadle pull NAME` (catalog.py); only the size is checked here
        return resolve_known(key, KNOWN_MODELS[key]), key
    path = Path(key).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file (or a Hugging Face directory)")
        return path, path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json")
        return path, path.name
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelLoadError(f"unknown model {key!r}: not a registered name ({known}), a .gguf file or a directory")


def load_model(name_or_path: str | Path = DEFAULT_MODEL) -> Model:
    path, name = resolve_model_path(name_or_path)
    if path.is_dir():
        cfg = read_config(path)
        declared = sentence_transformers_pooling(path)  # a sentence-transformers embedder's modules
        if declared is not None:
            cfg = replace(cfg, pooling=declared[0])
        weights = load_safetensors_directory(path, cfg)
        tokenizer = Tokenizer.from_hf_directory(path, cfg.bos_token_id, cfg.eos_token_ids)
        cfg = replace(cfg, add_bos_token=tokenizer.add_bos_token)
    else:
        cfg, weights, tok_data = load_gguf(path)
        tokenizer = Tokenizer.from_gguf(tok_data, cfg.eos_token_ids)
        del tok_data
        release_freed_heap()  # the parsed metadata's small objects
    types = ", ".join(f"{qtype} x{count}" for qtype, count in weights.storage_types().items())
    log.info("loaded %s: %d layers, dim %d, %.1f MB of weights; matrices as stored: %s", name, cfg.n_layers,
             cfg.dim, weights.nbytes / 1e6, types)
    return Model(config=cfg, weights=weights, tokenizer=tokenizer, path=path, name=name)


def load_any_model(name_or_path: str | Path = DEFAULT_MODEL) -> Model | EncoderModel:
    """A generation model (`load_model`), or an encoder where the directory holds one (BERT)."""
    path, name = resolve_model_path(name_or_path)
    if (path.is_dir() and is_encoder_directory(path)) or (path.is_file() and is_encoder_gguf(path)):
        model = load_encoder_directory(path, name) if path.is_dir() else load_encoder_gguf(path, name)
        log.info("loaded %s: a %s encoder (%s), %d layers, dim %d, %.1f MB of weights", name,
                 model.config.architecture, model.config.task, model.config.n_layers, model.config.dim,
                 model.weights.nbytes / 1e6)
        return model
    return load_model(name_or_path)
