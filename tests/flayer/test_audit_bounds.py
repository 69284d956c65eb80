"""flayer.audit.bounds: Clopper-Pearson, the epsilon lower bound's arithmetic, the two-Gaussian epsilon."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flayer.audit.bounds import (
    clopper_pearson_upper,
    epsilon_from_rates,
    epsilon_lower_bound,
    gaussian_pair_epsilon,
)
from flayer.engine.accountant import gaussian_epsilon


def test_clopper_pearson_upper_known_values():
    # no hit in n trials: 1 - alpha^(1/n) exactly
    assert clopper_pearson_upper(0, 50, 0.025) == pytest.approx(1 - 0.025 ** (1 / 50))
    assert clopper_pearson_upper(7, 7, 0.05) == 1.0
    assert 0.5 < clopper_pearson_upper(10, 20, 0.025) < 0.75
    with pytest.raises(ValueError):
        clopper_pearson_upper(3, 2, 0.05)


def test_epsilon_from_rates_both_forms():
    assert epsilon_from_rates(0.1, 0.2, 0.0) == pytest.approx(math.log(0.8 / 0.1))
    assert epsilon_from_rates(0.2, 0.1, 0.0) == pytest.approx(math.log(0.8 / 0.1))
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0
    assert epsilon_from_rates(0.0, 0.0, 0.0) == math.inf


def test_perfect_separation_is_capped_by_the_trial_count():
    b = epsilon_lower_bound([1.0] * 100, [0.0] * 100, 1e-5, confidence=0.95, calibrate=0.3)
    hi = 1 - 0.025 ** (1 / 70)
    assert b.fpr == b.fnr == 0 and b.certified_in == 70
    assert b.epsilon == pytest.approx(math.log((1 - 1e-5 - hi) / hi))
    assert 0 < b.threshold < 1


def test_indistinguishable_worlds_bound_nothing():
    rng = np.random.default_rng(0)
    b = epsilon_lower_bound(rng.normal(size=200), rng.normal(size=200), 1e-5)
    assert b.epsilon < 0.5
    with pytest.raises(ValueError):
        epsilon_lower_bound([1.0, float("nan")], [0.0, 0.0], 1e-5)


@pytest.mark.parametrize("z", [0.7, 1.5, 4.0])
def test_gaussian_pair_epsilon_matches_the_gaussian_mechanism(z):
    assert gaussian_pair_epsilon(0.0, z, 1.0, z, 1e-5) == pytest.approx(gaussian_epsilon(z, 1e-5), rel=1e-3)


def test_gaussian_pair_epsilon_grows_with_a_spread_mismatch():
    same = gaussian_pair_epsilon(0.0, 1.0, 0.3, 1.0, 1e-5)
    assert gaussian_pair_epsilon(0.0, 1.0, 0.3, 1.3, 1e-5) > same
    assert gaussian_pair_epsilon(0.0, 0.0, 1.0, 0.0, 1e-5) == math.inf
