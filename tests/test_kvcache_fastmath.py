import numpy as np
from numba import njit

from kvcache.fastmath import exp_f32


@njit(cache=True)
def exp_all(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = exp_f32(x[i])
    return out


def test_exp_f32_is_accurate_to_about_one_ulp_and_zero_below_the_float32_range():
    x = np.linspace(-100, 88, 400001).astype(np.float32)
    y = exp_all(x)
    inside = x > -87
    reference = np.exp(x[inside].astype(np.float64))
    assert np.max(np.abs(y[inside] - reference) / reference) < 2.5e-7
    assert np.all(y[~inside] == 0)
    assert exp_all(np.array([-np.inf, 0.0, 1.0], np.float32)).tolist() == [0.0, 1.0, np.float32(np.e)]
