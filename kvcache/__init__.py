"""Paged KV cache: block pool with prefix caching, per-sequence block tables, paged-attention kernels.

Import the submodules directly (`kvcache.manager`, `kvcache.attention`, ...): the bookkeeping
modules do not load numba, so a scheduler can be tested without compiling any kernel.
"""
