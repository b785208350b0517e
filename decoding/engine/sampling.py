"""The sampler: one token per sampled row, vectorised over the batch, each row with its own generator.

Every row draws exactly one uniform number from its own request's generator per token, and its
probabilities depend only on its own logits, so a seeded request gets the same tokens whatever
shares the batch. Python loops run over rows, never over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from kvcache.fastmath import exp_f32
from threadpool import SpinPool

from ..kernels.kernels import split_range
from .params import SamplingParams

# Nucleus sampling first looks among this many best tokens; only if they hold less than top_p of the
# probability mass does it sort the whole vocabulary.
_NUCLEUS_CANDIDATES = 1024
# Inverse-CDF sampling over the whole vocabulary finds the block holding the drawn mass first, then the
# token inside it: two short cumulative sums per row instead of one over 49152 values.
_CDF_BLOCK = 1024
_SUM_LANES = 16  # float64 partial sums per block: a vectorisable order, the same for every row
# Adjusted logits are held within this: divided by the lowest sampling temperature (1e-5) they stay
# finite in float32, so no row's weights become inf - inf.
_LOGIT_LIMIT = 1e30


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


# The logprob reported for a token that could not be drawn (a structured-output grammar forbade it):
# -inf is not JSON, so vLLM's floor.
MIN_REPORTED_LOGPROB = -9999.0


def reported_logprob(value: float) -> float:
    return max(float(value), MIN_REPORTED_LOGPROB)


def top_logprobs(logprobs_row: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    best = np.argpartition(-logprobs_row, k - 1)[:k]
    best = best[np.lexsort((best, -logprobs_row[best]))]  # by logprob, ties by id: deterministic
    return [(int(i), reported_logprob(logprobs_row[i])) for i in best]


def apply_penalties(row: np.ndarray, req: SampleRequest) -> None:
    """In place on one row of float64 logits."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(req.prompt_ids + req.output_ids, dtype=np.int64))
        values = row[seen]
        with np.errstate(over="ignore"):  # a penalty near 0: the caller bounds the row
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


def draw_full_vocabulary(logits: np.ndarray, rows: np.ndarray, temperatures: np.ndarray,
                         uniforms: np.ndarray, pool: SpinPool | None = None,
                         scratch: np.ndarray | None = None) -> np.ndarray:
    """Inverse-CDF sampling of softmax(logits[rows[i]] / temperatures[i]) with uniforms[i] → token ids.

    One pass of a numba kernel per row reads the logits where they lie: no scaled copy of the batch's
    (rows, vocab) logits, no temporaries (numpy's version made five passes over 6 MB at 32 rows, most
    of a 32-stream step's Python time). Block sums are accumulated in float64, so the drawn position
    is exact to ~1e-12 of the mass. With a `pool` the rows are shared among its threads (a row's draw
    never depends on which thread makes it, nor on the other rows). `scratch`: (≥ threads, ≥ vocab)
    float32, one row per thread, to keep the per-step path free of large allocations.
    """
    threads = pool.n_threads if pool is not None and rows.shape[0] > 1 else 1
    if scratch is None:
        scratch = np.empty((threads, logits.shape[1]), dtype=np.float32)
    tokens = np.empty(rows.shape[0], dtype=np.int64)
    args = (logits, rows.astype(np.int64), temperatures.astype(np.float32), uniforms.astype(np.float64), tokens)
    if threads > 1:
        pool.run(_draw_rows_shared, *args, scratch)
    else:
        _draw_rows(*args, scratch[0])
    return tokens


@njit(nogil=True, cache=True)
def _draw_rows_shared(tid, nthreads, barrier, logits, rows, temperatures, uniforms, tokens,  # type: ignore[no-untyped-def]
                      weights):
    begin, end = split_range(rows.shape[0], tid, nthreads)
    _draw_rows(logits, rows[begin:end], temperatures[begin:end], uniforms[begin:end], tokens[begin:end],
               weights[tid])


@njit(nogil=True, cache=True)
def _row_max(row):  # type: ignore[no-untyped-def]
    """max of a row, in independent lanes so that it vectorises (max is exact in any order)."""
    lanes = np.full(_SUM_LANES, row[0])
    j = 0
    while j + _SUM_LANES <= row.shape[0]:
        for lane in range(_SUM_LANES):
            lanes[lane] = max(lanes[lane], row[j + lane])
        j += _SUM_LANES
    best = lanes[0]
    for lane in range(1, _SUM_LANES):
        best = max(best, lanes[lane])
    for k in range(j, row.shape[0]):
        best = max(best, row[k])
    return best


@njit(nogil=True, cache=True)
def _draw_rows(logits, rows, temperatures, uniforms, tokens, weights):  # type: ignore[no-untyped-def]
    vocab = logits.shape[1]
    lanes = np.zeros(_SUM_LANES, dtype=np.float64)
    num_blocks = (vocab + _CDF_BLOCK - 1) // _CDF_BLOCK
    block_sums = np.zeros(num_blocks, dtype=np.float64)
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        inverse_temperature = np.float32(1.0) / temperatures[i]
        top = _row_max(row) * inverse_temperature  # max(x / t) = max(x) / t: division is monotonic
        total = 0.0
        for b in range(num_blocks):  # exp(x / t - top) and its sum: lanes, then a fixed sum of lanes
            lanes[:] = 0.0
            j, end = b * _CDF_BLOCK, min((b + 1) * _CDF_BLOCK, vocab)
            block_sum = 0.0
            while j + _SUM_LANES <= end:
                for lane in range(_SUM_LANES):  # vectorised: exp_f32 is plain arithmetic
                    weight = exp_f32(row[j + lane] * inverse_temperature - top)
                    weights[j + lane] = weight
                    lanes[lane] += weight
                j += _SUM_LANES
            for lane in range(_SUM_LANES):
                block_sum += lanes[lane]
            for k in range(j, end):
                weights[k] = exp_f32(row[k] * inverse_temperature - top)
                block_sum += weights[k]
            block_sums[b] = block_sum
            total += block_sum
        # The first token whose cumulative weight passes the target strictly, so that a token of weight 0
        # (masked) is never drawn: not with a target of exactly 0, nor where rounding leaves the target at
        # or past the end of the mass (then the last token with weight is taken).
        target = uniforms[i] * total
        before, b, last_block, before_last = 0.0, -1, 0, 0.0
        for candidate in range(num_blocks):
            if block_sums[candidate] > 0.0:
                last_block, before_last = candidate, before
                if before + block_sums[candidate] > target:
                    b = candidate
                    break
            before += block_sums[candidate]
        if b < 0:
            b, before = last_block, before_last
        j, end = b * _CDF_BLOCK, min((b + 1) * _CDF_BLOCK, vocab)
        cumulative, token = before, -1
        while j < end:
            if weights[j] > 0.0:
                token = j
                cumulative += weights[j]
                if cumulative > target:
                    break
            j += 1
        tokens[i] = token


def _draw(ids: np.ndarray, scores: np.ndarray, uniform: float) -> int:
    weights = np.exp(scores - scores.max())
    cumulative = np.cumsum(weights)
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))  # passes the target strictly
    if index >= ids.shape[0]:  # rounding put the target at the end of the mass: the last token with weight
        index = int(np.flatnonzero(weights)[-1])
    return int(ids[index])


def stop_ids_to_mask(req: SampleRequest, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids a row may not draw yet: before min_tokens tokens, EOS (unless ignored) and its stop token ids
    (vLLM's MinTokensLogitsProcessor). The row's own state only, so the batch cannot change its draw."""
    p = req.params
    if len(req.output_ids) >= p.min_tokens:
        return ()
    return p.stop_token_ids if p.ignore_eos else (*eos_token_ids, *p.stop_token_ids)


class Sampler:
    def __init__(self, vocab_size: int, pool: SpinPool | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.vocab_size = vocab_size
        self.pool = pool  # full-vocabulary draws are shared among its threads
        self.eos_token_ids = eos_token_ids  # masked, with a request's stop token ids, before its min_tokens
        self._draw_scratch = np.empty((pool.n_threads if pool is not None else 1, vocab_size), dtype=np.float32)

    def sample(self, logits: np.ndarray,
               requests: list[SampleRequest]) -> tuple[np.ndarray, list[TokenLogprobs | None]]:
        """logits: (rows, vocab) float32 → (token ids (rows,), per-row logprobs or None)."""
        num_rows = len(requests)
        tokens = np.empty(num_rows, dtype=np.int64)
        want_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = log_softmax(logits[want_logprobs]) if want_logprobs else None

        masked = [stop_ids_to_mask(r, self.eos_token_ids) for r in requests]
        adjusted = [i for i, r in enumerate(requests) if r.params.has_penalties or r.params.logit_bias or masked[i]]
        work = logits
        if adjusted:
            # float64 for the adjusted rows; the others round-trip to float32 exactly, so they draw the same
            work = logits.astype(np.float64)
            for i in adjusted:
                req = requests[i]
                apply_penalties(work[i], req)
                for token_id, bias in req.params.logit_bias.items():
                    work[i, token_id] += bias
                # a penalty near 0 divides past the float range; bounded, the row still draws a real token
                np.clip(work[i], -_LOGIT_LIMIT, _LOGIT_LIMIT, out=work[i])
                work[i, list(masked[i])] = -np.inf  # exp(-inf) = 0: never drawn, whatever the bias

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
            source = work if work.dtype == np.float32 else work.astype(np.float32)
            tokens[plain] = draw_full_vocabulary(source, np.asarray(plain), temperatures, np.asarray(uniforms),
                                                 self.pool, self._draw_scratch)

        results: list[TokenLogprobs | None] = [None] * num_rows
        for j, i in enumerate(want_logprobs):
            row = raw_logprobs[j]
            token = int(tokens[i])
            results[i] = TokenLogprobs(token, reported_logprob(row[token]),
                                       top_logprobs(row, requests[i].params.logprobs or 0))  # fmt: skip
        return tokens, results
