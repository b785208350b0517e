"""The sampler: one token per sampled row, vectorised over the batch, each row with its own generator.

Every row draws exactly one uniform number from its own request's generator per token, and its
probabilities depend only on its own logits, so a seeded request gets the same tokens whatever
shares the batch. Python loops run over rows, never over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import SamplingParams

# Nucleus sampling first looks among this many best tokens; only if they hold less than top_p of the
# probability mass does it sort the whole vocabulary.
_NUCLEUS_CANDIDATES = 1024
# Inverse-CDF sampling over the whole vocabulary finds the block holding the drawn mass first, then the
# token inside it: two short cumulative sums per row instead of one over 49152 values.
_CDF_BLOCK = 1024


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    rng: np.random.Generator
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # best first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise, float32 in, float32 out; computed in float64 so tails stay accurate."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z.astype(np.float32)


def top_logprobs(logprobs_row: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    best = np.argpartition(-logprobs_row, k - 1)[:k]
    best = best[np.lexsort((best, -logprobs_row[best]))]  # by logprob, ties by id: deterministic
    return [(int(i), float(logprobs_row[i])) for i in best]


def apply_penalties(row: np.ndarray, req: SampleRequest) -> None:
    """In place on one row of float64 logits."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(req.prompt_ids + req.output_ids, dtype=np.int64))
        values = row[seen]
        row[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_ids:
        ids, counts = np.unique(np.asarray(req.output_ids, dtype=np.int64), return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty


def _restrict_candidates(z: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, their scaled logits) after top-k, min-p and top-p, best first."""
    k = p.effective_top_k
    if k and k < z.shape[0]:
        ids = np.argpartition(-z, k - 1)[:k]
    elif p.top_p < 1.0 and z.shape[0] > _NUCLEUS_CANDIDATES:
        ids = np.argpartition(-z, _NUCLEUS_CANDIDATES - 1)[:_NUCLEUS_CANDIDATES]
        mass = np.exp(z[ids] - z.max()).sum() / np.exp(z - z.max()).sum()
        if mass < p.top_p:
            ids = np.arange(z.shape[0])
    else:
        ids = np.arange(z.shape[0])
    ids = ids[np.lexsort((ids, -z[ids]))]  # best first, ties by id
    scores = z[ids]
    probs = np.exp(scores - scores[0])
    keep = np.ones(ids.shape[0], dtype=bool)
    if p.min_p > 0.0:
        keep &= probs >= p.min_p  # probs are relative to the best token's
    if p.top_p < 1.0:
        cumulative = np.cumsum(probs / probs.sum())
        keep &= (cumulative - probs / probs.sum()) < p.top_p  # keep the token that crosses top_p
    keep[0] = True
    return ids[keep], scores[keep]


def draw_full_vocabulary(z: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling of softmax(z) row by row, vectorised: z (rows, vocab) float32 → token ids.

    Block sums are accumulated in float64, so the drawn position is exact to ~1e-12 of the mass.
    """
    rows, vocab = z.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    probs = np.zeros((rows, num_blocks * _CDF_BLOCK), dtype=np.float32)
    np.subtract(z, z.max(axis=1, keepdims=True), out=probs[:, :vocab])
    np.exp(probs[:, :vocab], out=probs[:, :vocab])
    blocks = probs.reshape(rows, num_blocks, _CDF_BLOCK)
    block_cdf = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)  # (rows, num_blocks)
    target = uniforms * block_cdf[:, -1]
    block = np.minimum((block_cdf < target[:, None]).sum(axis=1), num_blocks - 1)
    before = np.where(block > 0, block_cdf[np.arange(rows), block - 1], 0.0)
    inner_cdf = np.cumsum(blocks[np.arange(rows), block], axis=1, dtype=np.float64)  # (rows, _CDF_BLOCK)
    inner = np.minimum((inner_cdf < (target - before)[:, None]).sum(axis=1), _CDF_BLOCK - 1)
    tokens = block * _CDF_BLOCK + inner
    return np.minimum(tokens, vocab - 1)  # the zero padding past the vocabulary is never drawn


def _draw(ids: np.ndarray, scores: np.ndarray, uniform: float) -> int:
    weights = np.exp(scores - scores.max())
    cumulative = np.cumsum(weights)
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return int(ids[min(index, ids.shape[0] - 1)])


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def sample(self, logits: np.ndarray, requests: list[SampleRequest]) -> tuple[np.ndarray, list[TokenLogprobs | None]]:
        """logits: (rows, vocab) float32 → (token ids (rows,), per-row logprobs or None)."""
        num_rows = len(requests)
        tokens = np.empty(num_rows, dtype=np.int64)
        want_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = log_softmax(logits[want_logprobs]) if want_logprobs else None

        adjusted = [i for i, r in enumerate(requests) if r.params.has_penalties or r.params.logit_bias]
        work = logits
        if adjusted:
            work = logits.astype(np.float64)
            for i in adjusted:
                req = requests[i]
                apply_penalties(work[i], req)
                for token_id, bias in req.params.logit_bias.items():
                    work[i, token_id] += bias

        uniforms: list[float] = []
        greedy = [i for i, r in enumerate(requests) if r.params.is_greedy]
        if greedy:
            tokens[greedy] = np.argmax(work[greedy], axis=-1)
        plain: list[int] = []
        for i, req in enumerate(requests):
            p = req.params
            if p.is_greedy:
                continue
            uniform = req.rng.random()  # exactly one draw per token: reproducible whatever the batch
            if p.effective_top_k or p.top_p < 1.0 or p.min_p > 0.0:
                ids, scores = _restrict_candidates(work[i].astype(np.float64) / p.temperature, p)
                tokens[i] = _draw(ids, scores, uniform)
            else:
                plain.append(i)
                uniforms.append(uniform)
        if plain:
            temperatures = np.array([requests[i].params.temperature for i in plain], dtype=np.float32)
            scaled = work[plain].astype(np.float32) / temperatures[:, None]
            tokens[plain] = draw_full_vocabulary(scaled, np.asarray(uniforms))

        results: list[TokenLogprobs | None] = [None] * num_rows
        for j, i in enumerate(want_logprobs):
            row = raw_logprobs[j]
            token = int(tokens[i])
            results[i] = TokenLogprobs(token, float(row[token]), top_logprobs(row, requests[i].params.logprobs or 0))
        return tokens, results
