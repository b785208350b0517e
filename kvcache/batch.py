"""The int32 arrays the attention and KV-write kernels read for one step's flat batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcache.errors import KVCacheError
from kvcache.manager import KVCacheManager


@dataclass(slots=True)
class KVBatchArrays:
    """One step's view of the KV cache: sequence s owns query rows [query_start_loc[s], query_start_loc[s+1])."""

    block_tables: np.ndarray  # (num_seqs, max_blocks_in_batch) int32; 0 past a sequence's blocks, never read
    context_lens: np.ndarray  # (num_seqs,) int32: positions each sequence attends over, this step's included
    query_start_loc: np.ndarray  # (num_seqs + 1,) int32: prefix sums of the query lengths
    positions: np.ndarray  # (num_tokens,) int32: position of each query row in its sequence (for RoPE)
    slot_mapping: np.ndarray  # (num_tokens,) int32: block_id * block_size + offset receiving each row's K/V


def build_batch_arrays(
    kv: KVCacheManager, seq_ids: Sequence[int], query_lens: Sequence[int]
) -> KVBatchArrays:
    """Arrays for a step whose sequence `seq_ids[s]` computes its last `query_lens[s]` positions.

    Call after this step's `append_slots`: `query_lens[s]` is how many tokens that call was given, and
    the queries are the sequence's newest positions. Vectorised over the batch: a few dozen numpy
    calls plus one row copy per sequence, whatever the prompt lengths.
    """
    num_seqs = len(seq_ids)
    context_lens = np.fromiter((kv.num_tokens(seq_id) for seq_id in seq_ids), np.int32, num_seqs)
    query_lens_array = np.asarray(query_lens, dtype=np.int32).reshape(num_seqs)
    if np.any(query_lens_array < 0) or np.any(query_lens_array > context_lens):
        raise KVCacheError("each query length must lie between 0 and the sequence's context length")

    tables = [kv.block_table(seq_id) for seq_id in seq_ids]
    block_tables = np.zeros((num_seqs, max((len(table) for table in tables), default=1)), dtype=np.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = table

    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens_array, out=query_start_loc[1:])
    seq_of_row = np.repeat(np.arange(num_seqs), query_lens_array)  # (num_tokens,)
    first_position = context_lens - query_lens_array  # (num_seqs,) position of each sequence's first query
    positions = np.arange(query_start_loc[-1], dtype=np.int32)
    positions += (first_position - query_start_loc[:-1])[seq_of_row]
    block_size = kv.block_size
    slot_mapping = block_tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    return KVBatchArrays(
        block_tables, context_lens, query_start_loc, positions, slot_mapping.astype(np.int32)
    )
