"""Flatten a ScheduledStep into the runner's StepBatch."""

from __future__ import annotations

import numpy as np

from kvcache.batch import build_batch_arrays
from kvcache.manager import KVCacheManager

from .runner import StepBatch
from .step import ScheduledStep


def build_step_batch(kv: KVCacheManager, scheduled: ScheduledStep) -> tuple[StepBatch, list[int]]:
    """The batch, and for each chunk the index of its first logits row (-1 if it needs none).

    A chunk needs logits for its last row when it samples, and for every row while a request asks
    for prompt logprobs or when it verifies draft tokens; only those rows go through the final norm
    and the LM head. The embedding inputs' rows follow the chunks'; the rows their pooling reads go
    through the final norm only, after the rows with logits.
    """
    parts = [*scheduled.chunks, *scheduled.embeddings]
    num_tokens = scheduled.num_tokens + scheduled.num_embedding_tokens
    token_ids = np.fromiter((t for c in parts for t in c.token_ids), dtype=np.int32, count=num_tokens)
    seq_ids = [c.seq.seq_id for c in scheduled.chunks] + [c.input.seq_id for c in scheduled.embeddings]
    arrays = build_batch_arrays(kv, seq_ids, [c.num_tokens for c in parts])
    logit_rows: list[int] = []
    first_rows: list[int] = []
    row = 0
    for chunk in scheduled.chunks:
        end = row + chunk.num_tokens
        if chunk.num_draft_tokens or (chunk.seq.params.prompt_logprobs is not None and not chunk.seq.output_ids):
            first_rows.append(len(logit_rows))
            logit_rows.extend(range(row, end))
        elif chunk.samples:
            first_rows.append(len(logit_rows))
            logit_rows.append(end - 1)
        else:
            first_rows.append(-1)
        row = end
    num_pooled_rows = 0
    for embedding in scheduled.embeddings:
        logit_rows.extend(row + offset for offset in embedding.pooled_rows)
        num_pooled_rows += len(embedding.pooled_rows)
        row += embedding.num_tokens
    batch = StepBatch(token_ids, arrays, np.asarray(logit_rows, dtype=np.int32), scheduled.block_copies,
                      num_pooled_rows)
    return batch, first_rows
