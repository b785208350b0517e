"""A mixture of experts' feed-forward inside the model step: route, group by expert, run each chosen
expert once for all of its tokens, combine.

    route    (each thread, its own tokens, before the feed-forward norm's barrier): the router's
             scores, their softmax, the n_used largest, renormalised where the model says so
    group    (every thread, the same answer, no barrier): the step's (token, choice) pairs ordered
             by expert, then by token
    gather   each pair's normed input row into one contiguous block per expert
    experts  for each expert with tokens: gate·up over its block, then down; every expert's rows are
             split between the threads, so one token or hundreds keep the whole pool busy
    combine  (each thread, its own tokens): x[t] += Σ_j weight[t, j] · out[pair(t, j)], j in rank order

Each chosen expert's weights are read once a step, however many tokens chose it. A token's numbers
do not depend on the step it shares: the same dot products (decoding.kernels.fast_kernels computes a
row's products alike in groups of one or four tokens), summed in its own choices' order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from threadpool import barrier_wait

from .fast_kernels import matmul_groups, quantize_activation_row, swiglu_groups
from .kernels import dot, matmul_rows, split_range, swiglu_rows
from .phases import DOWN_PROJECTION, GATE_UP, GATHER_EXPERTS, QUANTIZE_HIDDEN, lap


@njit(nogil=True, cache=True, error_model="numpy")
def route_tokens(xb, router, n_used, normalise, t_begin, t_end, scores, choices, weights):
    """choices[t, :n_used] = the experts of token t, best first (the lower index on a tie), and
    weights[t] theirs: softmax probabilities over every expert, renormalised over the chosen if
    `normalise`. router: (n_experts, dim) float32; scores: (≥t_end, n_experts) scratch."""
    n_experts, dim = router.shape
    for t in range(t_begin, t_end):
        p = scores[t]
        top = np.float32(-np.inf)
        for e in range(n_experts):
            p[e] = dot(router[e], xb[t], dim)
            top = max(top, p[e])
        total = np.float32(0.0)
        for e in range(n_experts):
            p[e] = np.exp(p[e] - top)
            total += p[e]
        chosen_total = np.float32(0.0)
        for j in range(n_used):
            best = 0
            for e in range(1, n_experts):
                if p[e] > p[best]:
                    best = e
            choices[t, j] = best
            weights[t, j] = p[best] / total
            chosen_total += weights[t, j]
            p[best] = np.float32(-1.0)  # taken: below every probability
        if normalise:
            for j in range(n_used):
                weights[t, j] /= chosen_total


@njit(nogil=True, cache=True)
def group_by_expert(choices, n_tokens, n_experts, offsets, cursor, pair_token, pair_of):
    """Pairs (t, j) ordered by expert then token: expert e's are pair_token[offsets[e]:offsets[e+1]]
    (their tokens), and pair_of[t · n_used + j] is where token t's j-th choice landed."""
    n_used = choices.shape[1]
    offsets[: n_experts + 1] = 0
    for t in range(n_tokens):
        for j in range(n_used):
            offsets[choices[t, j] + 1] += 1
    for e in range(n_experts):
        offsets[e + 1] += offsets[e]
        cursor[e] = offsets[e]
    for t in range(n_tokens):
        for j in range(n_used):
            e = choices[t, j]
            pair_token[cursor[e]] = t
            pair_of[t * n_used + j] = cursor[e]
            cursor[e] += 1


# fmt: off
@njit(nogil=True, cache=True)
def expert_feed_forward(tid, nthreads, barrier, fast, n_tokens, t_begin, t_end, x, xb, xq, xd, xsum,
                        gate, up, down, gate_packed, up_packed, down_packed, qtypes, packed_qtypes, n_experts,
                        activation, choices, weights, offsets, cursor, pair_token, pair_of, rows, hidden, up_rows,
                        pair_q, pair_d, pair_sum, buf, tmp, untiled, tile_out, profile, clock):
    """x[t] += the mixture's output for the step's tokens, from their normed rows xb (and, fast,
    their quantized xq/xd/xsum) and `choices`/`weights` (route_tokens). gate, up: (n_experts · hidden,
    row_bytes) stacked experts; down: (n_experts · dim, ...); *_packed their repacked copies or empty;
    qtypes/packed_qtypes: this layer's seven. Scratch per pair: `rows` (dim: the gathered input, then
    the experts' outputs), `hidden`, `up_rows`, `pair_q/d/sum`; per thread: offsets, cursor,
    pair_token, pair_of; `untiled`/`tile_out` as the fast kernels take them (the gathered rows are not in AMX
    tiles' layout). Every thread calls it; it ends after the combine, without a barrier, and
    returns the phase clock (decoding.kernels.phases) as it stood before the combine."""
    dim = x.shape[1]
    hidden_dim = gate.shape[0] // n_experts
    n_pairs = n_tokens * choices.shape[1]
    group_by_expert(choices, n_tokens, n_experts, offsets, cursor, pair_token, pair_of)
    gate_bytes, up_bytes = gate_packed.shape[0] // n_experts, up_packed.shape[0] // n_experts
    packed_gate_up = fast and gate_bytes > 0 and up_bytes > 0
    p0, p1 = split_range(n_pairs, tid, nthreads)
    for p in range(p0, p1):  # gather
        t = pair_token[p]
        if packed_gate_up:
            pair_q[p, :dim] = xq[t, :dim]
            pair_d[p, : dim // 32] = xd[t, : dim // 32]
            pair_sum[p, : dim // 32] = xsum[t, : dim // 32]
        else:
            rows[p, :dim] = xb[t, :dim]
    barrier_wait(barrier, tid)
    clock = lap(profile, GATHER_EXPERTS, clock)

    for e in range(n_experts):  # gate and up of each expert with tokens
        c0, c1 = offsets[e], offsets[e + 1]
        if c0 == c1:
            continue
        if packed_gate_up:
            g0, g1 = split_range(hidden_dim // 8, tid, nthreads)
            swiglu_groups(gate_packed[e * gate_bytes : (e + 1) * gate_bytes],
                          up_packed[e * up_bytes : (e + 1) * up_bytes], packed_qtypes[4], packed_qtypes[5], dim,
                          pair_q[c0:c1], pair_d[c0:c1], pair_sum[c0:c1], c1 - c0, hidden[c0:c1], up_rows[c0:c1],
                          g0, g1, tmp[0], tmp[1], activation, untiled, tile_out)
        else:
            r0, r1 = split_range(hidden_dim, tid, nthreads)
            swiglu_rows(gate[e * hidden_dim : (e + 1) * hidden_dim], qtypes[4],
                        up[e * hidden_dim : (e + 1) * hidden_dim], qtypes[5], dim, rows[c0:c1], c1 - c0,
                        hidden[c0:c1], r0, r1, buf[0], buf[1], activation)
    barrier_wait(barrier, tid)
    clock = lap(profile, GATE_UP, clock)

    down_bytes = down_packed.shape[0] // n_experts
    packed_down = fast and down_bytes > 0
    if packed_down:
        for p in range(p0, p1):
            quantize_activation_row(hidden[p], hidden_dim, pair_q[p], pair_d[p], pair_sum[p])
        barrier_wait(barrier, tid)
        clock = lap(profile, QUANTIZE_HIDDEN, clock)
    for e in range(n_experts):  # down projection of each expert with tokens, into `rows`
        c0, c1 = offsets[e], offsets[e + 1]
        if c0 == c1:
            continue
        if packed_down:
            g0, g1 = split_range(dim // 8, tid, nthreads)
            matmul_groups(down_packed[e * down_bytes : (e + 1) * down_bytes], packed_qtypes[6], hidden_dim,
                          pair_q[c0:c1], pair_d[c0:c1], pair_sum[c0:c1], c1 - c0, rows[c0:c1], g0, g1, False, tmp[0],
                          untiled, tile_out[0])
        else:
            r0, r1 = split_range(dim, tid, nthreads)
            matmul_rows(down[e * dim : (e + 1) * dim], qtypes[6], hidden_dim, hidden[c0:c1], c1 - c0, rows[c0:c1], 0,
                        r0, r1, False, buf[0])
    barrier_wait(barrier, tid)
    clock = lap(profile, DOWN_PROJECTION, clock)

    n_used = choices.shape[1]
    for t in range(t_begin, t_end):  # combine, in the token's own rank order
        for j in range(n_used):
            p = pair_of[t * n_used + j]
            w = weights[t, j]
            for i in range(dim):
                x[t, i] += w * rows[p, i]
    return clock
# fmt: on

