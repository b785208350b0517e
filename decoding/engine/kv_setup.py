"""The KV cache an engine serves from: its layout, its size, its arrays and its prefix tiers."""

from __future__ import annotations

import logging
from pathlib import Path

from kvcache import key_centres
from kvcache.manager import KVCacheManager
from kvcache.prefix_tiers import PrefixTiers, TierSettings, file_fingerprint, namespace
from kvcache.storage import KVCacheSpec, KVCacheStorage

from ..kernels import weight_cache
from ..model.model import Model
from . import memory
from .config import EngineConfig, resolve_kv_cache_dtype

log = logging.getLogger(__name__)


def kv_cache_spec(model: Model, cfg: EngineConfig) -> KVCacheSpec:
    mc = model.config
    return KVCacheSpec(n_layers=mc.n_layers, n_kv_heads=mc.n_kv_heads, head_dim=mc.head_dim,
                       block_size=cfg.block_size, dtype=resolve_kv_cache_dtype(cfg))


def key_centres_cache(model: Model, cfg: EngineConfig, spec: KVCacheSpec, kv: KVCacheManager) -> Path | None:
    """Where an int8 cache's key centres for this model and configuration are kept (beside the weight
    cache; None where it is off or the model has no file): named after the prefix tiers' namespace (the
    manager's root hash), so that the centres change exactly where the KV blocks those tiers keep would."""
    if not cfg.weight_cache or not model.path.is_file():
        return None
    configuration = f"{spec.dtype}-block{spec.block_size}-{cfg.kernels}"
    return key_centres.cache_path(weight_cache.weight_cache_dir(), model.path, configuration, kv.pool.root_hash)


def build_kv_cache(model: Model, cfg: EngineConfig, spec: KVCacheSpec, num_blocks: int, max_model_len: int,
                   prefix_ram_bytes: int) -> tuple[KVCacheStorage, KVCacheManager]:
    """Touch the KV arrays and put the block manager over them. Prefix hashes start from a namespace
    binding the model file, KV dtype, block size and kernel mode, so no tier serves one configuration
    another's KV."""
    storage = KVCacheStorage.allocate(spec, num_blocks)
    model_fingerprint = file_fingerprint(model.path) if model.path.exists() else bytes(16)
    root_hash = namespace(model_fingerprint, spec.dtype, spec.block_size, cfg.kernels)
    kv = KVCacheManager(num_blocks, cfg.block_size, max_model_len, cfg.enable_prefix_caching, root_hash)
    if cfg.enable_prefix_caching:
        directory = Path(cfg.prefix_cache_dir).expanduser() if cfg.prefix_cache_dir else None
        if directory is not None and not model.path.exists():
            log.warning("no prefix cache on disk: the model has no file to name its blocks after")
            directory = None
        settings = TierSettings(prefix_ram_bytes, directory, int(cfg.prefix_cache_disk_mb * memory.MIB))
        tiers = PrefixTiers(storage, settings, root_hash, model_fingerprint, cfg.kernels)
        if tiers.is_enabled:
            kv.attach_tiers(tiers)
            log.info(tiers.describe())
    return storage, kv
