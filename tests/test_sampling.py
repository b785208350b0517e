import numpy as np
import pytest

from decoding.engine.params import InvalidParams, SamplingParams
from decoding.engine.sampling import Sampler, SampleRequest, apply_penalties, log_softmax

VOCAB = 6
LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9], dtype=np.float32))


def request(seed=0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), np.random.default_rng(seed), [1, 2], [])


def draw(n: int, seed: int = 0, **params) -> np.ndarray:
    """n tokens from one request's generator, one sampler call per token as in the engine."""
    sampler, req = Sampler(VOCAB), request(seed, **params)
    return np.array([sampler.sample(LOGITS[None], [req])[0][0] for _ in range(n)])


def test_greedy_takes_the_argmax_and_breaks_ties_by_lowest_id():
    logits = np.array([[0.0, 3.0, 3.0, 1.0]], dtype=np.float32)
    tokens, _ = Sampler(4).sample(logits, [request(temperature=0)])
    assert tokens.tolist() == [1]


def test_sampling_follows_the_softmax():
    tokens = draw(20000, temperature=1.0)
    freq = np.bincount(tokens, minlength=VOCAB) / tokens.size
    expected = np.exp(LOGITS) / np.exp(LOGITS).sum()
    assert np.all(np.abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / tokens.size) + 1e-6)


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(draw(4000, temperature=0.3), minlength=VOCAB)
    hot = np.bincount(draw(4000, temperature=3.0), minlength=VOCAB)
    assert cold[0] > hot[0] and cold[3] < hot[3]


def test_same_seed_same_tokens_other_seed_other_tokens():
    assert np.array_equal(draw(50, seed=42), draw(50, seed=42))
    assert not np.array_equal(draw(50, seed=42), draw(50, seed=43))


def test_a_rows_tokens_do_not_depend_on_the_other_rows():
    sampler = Sampler(VOCAB)
    alone_req = request(seed=9)
    alone = [sampler.sample(LOGITS[None], [alone_req])[0][0] for _ in range(30)]
    crowd_req = request(seed=9)
    others = [request(seed=s, top_k=2) for s in range(5)] + [request(temperature=0)]
    crowd = []
    for _ in range(30):
        batch = np.repeat(LOGITS[None], 7, axis=0)
        tokens, _ = sampler.sample(batch, others[:3] + [crowd_req] + others[3:])
        crowd.append(tokens[3])
    assert alone == crowd


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 1}, {0}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7: the token that crosses top_p is kept
        ({"top_p": 0.4}, {0}),
        ({"min_p": 0.5}, {0, 1}),  # 0.3 ≥ 0.5 · 0.5
        ({"min_p": 0.7}, {0}),
        ({"top_k": 3, "top_p": 0.9, "min_p": 0.2}, {0, 1, 2}),
    ],
)
def test_truncation_keeps_only_the_allowed_tokens(params, allowed):
    tokens = set(draw(3000, **params).tolist())
    assert tokens == allowed


def test_logit_bias_forces_and_forbids_tokens():
    assert set(draw(200, logit_bias={4: 100.0}).tolist()) == {4}
    assert 0 not in set(draw(500, logit_bias={0: -100.0}).tolist())


def test_penalties_follow_vllm_and_openai_definitions():
    row = np.array([2.0, -2.0, 1.0, 0.5, 0.0, 3.0])
    req = SampleRequest(SamplingParams(repetition_penalty=2.0), np.random.default_rng(), [0], [1])
    apply_penalties(row, req)
    assert row.tolist() == [1.0, -4.0, 1.0, 0.5, 0.0, 3.0]
    row = np.zeros(VOCAB)
    req = SampleRequest(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), np.random.default_rng(), [0],
                        [2, 2, 2, 5])
    apply_penalties(row, req)
    assert row.tolist() == [0.0, 0.0, -1.25, 0.0, 0.0, -0.75]


def test_logprobs_are_the_models_log_probabilities_best_first():
    sampler = Sampler(VOCAB)
    tokens, logprobs = sampler.sample(LOGITS[None], [request(temperature=0, logprobs=3)])
    expected = log_softmax(LOGITS[None])[0]
    lp = logprobs[0]
    assert lp.token_id == tokens[0] == 0
    assert lp.logprob == pytest.approx(expected[0], abs=1e-6)
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert [v for _, v in lp.top] == pytest.approx(expected[[0, 1, 2]].tolist(), abs=1e-6)
    _, none = sampler.sample(LOGITS[None], [request(temperature=0)])
    assert none == [None]


@pytest.mark.parametrize(
    "params",
    [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 2}, {"max_tokens": 0},
     {"n": 0}, {"logprobs": 21}, {"presence_penalty": 3}, {"temperature": float("nan")},
     {"stop": ("",)}, {"logit_bias": {1: 1000.0}}, {"repetition_penalty": 0}, {"min_tokens": -1},
     {"min_tokens": 17}, {"max_tokens": 4, "min_tokens": 5}],
)
def test_out_of_range_parameters_name_themselves(params):
    with pytest.raises(InvalidParams) as info:
        SamplingParams(**params)
    assert info.value.param in {*params, "temperature"}
    if "min_tokens" in params:
        assert info.value.param == "min_tokens"


def test_blocked_inverse_cdf_draws_the_same_tokens_as_a_plain_one():
    from decoding.engine.sampling import draw_full_vocabulary

    rng = np.random.default_rng(8)
    z = (rng.standard_normal((9, 3000)) * 3).astype(np.float32)  # not a multiple of the block size
    rows = np.array([4, 0, 7, 7, 2, 8])  # any subset of the batch, in any order
    temperatures = np.array([1.0, 0.5, 1.7, 1.0, 0.9, 3.0], dtype=np.float32)
    uniforms = rng.random(6)
    tokens = draw_full_vocabulary(z, rows, temperatures, uniforms)
    for row, t, u, token in zip(z[rows].astype(np.float64), temperatures, uniforms, tokens, strict=True):
        scaled = row / t
        cdf = np.cumsum(np.exp(scaled - scaled.max()))
        expected = np.searchsorted(cdf, u * cdf[-1], side="left")
        # float32 exponentials against float64 ones: the drawn position may only move across a
        # boundary that lies within rounding of the target
        assert token == expected or abs(cdf[min(token, expected)] - u * cdf[-1]) < 1e-5 * cdf[-1]


def test_draws_shared_among_pool_threads_equal_the_single_threaded_ones():
    from decoding.engine.sampling import draw_full_vocabulary
    from threadpool import SpinPool

    rng = np.random.default_rng(11)
    z = (rng.standard_normal((7, 5000)) * 2).astype(np.float32)
    rows, temperatures, uniforms = np.array([6, 1, 3, 0, 5]), np.full(5, 0.7, np.float32), rng.random(5)
    alone = draw_full_vocabulary(z, rows, temperatures, uniforms)
    with SpinPool(2, pin=False) as pool:
        shared = draw_full_vocabulary(z, rows, temperatures, uniforms, pool)
        single_row = draw_full_vocabulary(z, rows[:1], temperatures[:1], uniforms[:1], pool)
    np.testing.assert_array_equal(shared, alone)
    assert single_row[0] == alone[0]


def test_min_tokens_masks_eos_and_the_stop_token_ids_until_reached():
    """vLLM's MinTokensLogitsProcessor: while a sequence has fewer than min_tokens tokens, EOS (unless
    ignore_eos) and its stop token ids get -inf logits, so neither can be drawn."""
    sampler = Sampler(VOCAB, eos_token_ids=(0,))

    def tokens(output_ids: list[int], count: int = 1, **params) -> set[int]:
        req = SampleRequest(SamplingParams(max_tokens=8, **params), np.random.default_rng(1), [1, 2], output_ids)
        return {int(sampler.sample(LOGITS[None], [req])[0][0]) for _ in range(count)}

    assert tokens([3], temperature=0, min_tokens=2, stop_token_ids=(1,)) == {2}
    assert tokens([3], 2000, min_tokens=2, stop_token_ids=(1,)) == {2, 3}  # 4 and 5 are 1e-9 likely
    assert tokens([3], 200, top_k=3, min_tokens=2) == {1, 2, 3}
    assert tokens([3, 3], temperature=0, min_tokens=2, stop_token_ids=(1,)) == {0}  # reached: nothing masked
    assert tokens([3], temperature=0, min_tokens=2, ignore_eos=True) == {0}  # with ignore_eos EOS is no stop
    assert tokens([], temperature=0, min_tokens=1, logit_bias={0: 100.0}) == {1}  # the mask wins over a bias


def test_a_masked_row_and_its_neighbours_do_not_change_each_other():
    sampler = Sampler(VOCAB, eos_token_ids=(0,))

    def run(batch_of: list[list[SampleRequest]], index: int) -> list[int]:
        drawn = []
        for batch in batch_of:
            tokens, _ = sampler.sample(np.repeat(LOGITS[None], len(batch), axis=0), batch)
            drawn.append(int(tokens[index]))
        return drawn

    def masked(seed: int) -> SampleRequest:
        return SampleRequest(SamplingParams(max_tokens=50, min_tokens=40), np.random.default_rng(seed), [1], [])

    plain_alone, masked_alone = request(seed=9), masked(4)
    plain_crowded, masked_crowded = request(seed=9), masked(4)
    crowd = [masked(s) for s in range(3)]
    assert run([[plain_alone]] * 30, 0) == run([[crowd[0], plain_crowded, crowd[1]]] * 30, 1)
    assert run([[masked_alone]] * 30, 0) == run([[request(seed=2), masked_crowded, crowd[2]]] * 30, 1)


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("temperature", [9e-6, 1e-9, 1e-40, 1e-310])
def test_a_temperature_below_1e_5_is_greedy(temperature, top_k):
    """As vLLM (_SAMPLING_EPS): 1/t would overflow float32 (or float64) and draw token 0 whatever the logits."""
    assert SamplingParams(temperature=temperature).is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    logits = (np.random.default_rng(5).standard_normal((4, 500)) * 4).astype(np.float32)
    requests = [SampleRequest(SamplingParams(temperature=temperature, top_k=top_k), np.random.default_rng(i), [1], [])
                for i in range(4)]
    tokens, _ = Sampler(500).sample(logits, requests)
    assert tokens.tolist() == np.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("uniform", [0.0, np.nextafter(1.0, 0.0)])
def test_a_masked_token_is_never_drawn_even_at_the_ends_of_the_uniform_range(uniform):
    """The draw's edges: a uniform of exactly 0 lands before any mass, one just under 1 at (or, rounded,
    past) the end of it. Either way the token drawn has weight; the masked ones (logit -inf: EOS before
    min_tokens, a forbidding logit_bias, padding past the real vocabulary) lie at both ends here."""
    from decoding.engine.sampling import draw_full_vocabulary

    vocab = 3000  # three CDF blocks; the last is masked whole, as a padded vocabulary's tail is
    row = np.random.default_rng(3).standard_normal(vocab).astype(np.float32)
    row[:5] = -np.inf
    row[2000:] = -np.inf
    token = draw_full_vocabulary(row[None], np.array([0]), np.array([1.0], np.float32), np.array([uniform]))[0]
    assert np.isfinite(row[token])
    sampler = Sampler(vocab)
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, top_k=2500, seed=0),
                   SamplingParams(temperature=1.0, top_p=0.999999, seed=0)):
        request = SampleRequest(params=params, rng=_FixedDraw(uniform), prompt_ids=[1], output_ids=[])
        tokens, _ = sampler.sample(row[None].copy(), [request])
        assert np.isfinite(row[tokens[0]]), params


class _FixedDraw:
    """A generator whose every draw is one chosen number: the edges a seeded one reaches only rarely."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 5e-324, "temperature": 1.0},  # positive logits divided past float64's range
    {"repetition_penalty": 5e-324, "temperature": 1.0, "top_p": 0.5},
    {"repetition_penalty": 5e-324, "temperature": 0.0},
    {"repetition_penalty": 1e-300, "temperature": 0.7, "top_k": 3},
])  # fmt: skip
def test_an_extreme_penalty_still_draws_a_token_of_the_vocabulary(params):
    """The fuzzer found it: repetition_penalty near 0 made seen tokens' logits infinite, the draw returned
    no token at all, and the grammar matcher then failed the step. Every draw is a real token."""
    logits = np.array([[2.0, 1.0, 3.0, -1.0, 0.5, 0.1]], dtype=np.float32)  # 1 and 2 are in the prompt
    for seed in range(20):
        tokens, _ = Sampler(VOCAB).sample(logits, [request(seed, **params)])
        assert tokens[0] in (1, 2), tokens  # the seen positive logits, now the largest by far
