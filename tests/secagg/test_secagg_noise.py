"""The discrete Gaussian sampler of distributed DP in the ring (flayer.secagg.noise)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flayer.secagg.noise import discrete_gaussian


def test_the_samples_follow_the_discrete_gaussian_pmf():
    x = discrete_gaussian(1.0, 200_000, np.random.default_rng(0))
    z = sum(math.exp(-k * k / 2) for k in range(-30, 31))
    for k in range(-3, 4):
        want = math.exp(-k * k / 2) / z
        assert abs(np.mean(x == k) - want) < 4 * math.sqrt(want * (1 - want) / x.size), k
    assert x.dtype == np.int64


@pytest.mark.parametrize("sigma", [0.3, 7.0, 1.6e6])
def test_mean_zero_and_the_asked_spread(sigma):
    x = discrete_gaussian(sigma, 100_000, np.random.default_rng(1)).astype(np.float64)
    assert abs(x.mean()) < 5 * max(sigma, 0.3) / math.sqrt(x.size)
    if sigma >= 1:
        assert x.std() == pytest.approx(sigma, rel=0.02)


def test_no_noise_and_bad_sigmas():
    assert not discrete_gaussian(0.0, 5, np.random.default_rng(0)).any()
    for bad in (-1.0, float("nan"), float("inf"), 2.0**41):
        with pytest.raises(ValueError, match="sigma"):
            discrete_gaussian(bad, 3, np.random.default_rng(0))
