"""Why the KV cache refuses a request.

All are `ValueError`s so that a layer which only knows "bad input" can still catch them; the
subclasses tell the scheduler whether waiting could ever help.
"""

from __future__ import annotations


class KVCacheError(ValueError):
    """The KV cache cannot do what was asked."""


class SequenceTooLong(KVCacheError):
    """The sequence would hold more tokens than the model's context (`max_model_len`)."""


class CacheTooSmall(KVCacheError):
    """The sequence needs more blocks than the whole cache has: waiting for others to finish cannot help."""


class OutOfBlocks(KVCacheError):
    """Not enough free blocks right now: the caller skipped `can_allocate` / `can_append`."""
