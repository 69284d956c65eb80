"""The privacy accountant (flayer.engine.accountant): epsilon for known (q, z, T) against values computed
independently here, planning z and rounds for a target, the ledger's checkpoint round trip, and a target
epsilon that stops a simulation at the right round."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flayer.config import TrainConfig
from flayer.engine import select_clients
from flayer.engine.accountant import Ledger, LedgerError, epsilon_for, noise_for_target, rounds_for_target
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # Opacus's default orders


def _balle(rdp: np.ndarray, delta: float) -> float:
    """RDP -> (epsilon, delta), Balle et al. 2020 Thm 21, written out here."""
    a = np.array(ORDERS, dtype=float)
    return float(np.nanmin(rdp - (np.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)))


def test_full_participation_matches_the_gaussian_mechanism_in_closed_form():
    # q = 1: T rounds of the Gaussian mechanism of multiplier z have RDP T * alpha / (2 z^2) (Mironov 2017)
    for z, t, delta in ((1.0, 10, 1e-5), (2.5, 100, 1e-6), (0.8, 3, 1e-3)):
        closed = _balle(t * np.array(ORDERS) / (2 * z * z), delta)
        assert epsilon_for([(z, 1.0, t)], delta) == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("q, z, t, delta", [(0.01, 1.1, 1000, 1e-5), (0.1, 1.0, 50, 1e-4), (0.2, 2.0, 200, 1e-6)])
def test_subsampled_epsilon_matches_the_librarys_reference_analysis(q, z, t, delta):
    from opacus.accountants.analysis.rdp import compute_rdp

    reference = _balle(np.array(compute_rdp(q=q, noise_multiplier=z, steps=t, orders=ORDERS)), delta)
    assert epsilon_for([(z, q, t)], delta) == pytest.approx(reference, rel=1e-9)
    # subsampling amplifies: far below the q = 1 figure, and more rounds cost more
    assert epsilon_for([(z, q, t)], delta) < epsilon_for([(z, 1.0, t)], delta)
    assert epsilon_for([(z, q, t)], delta) < epsilon_for([(z, q, 2 * t)], delta)


def test_no_noise_is_an_infinite_epsilon_and_nothing_composed_is_zero():
    assert math.isinf(epsilon_for([(0.0, 0.1, 3)], 1e-5))
    assert Ledger().epsilon(1e-5) == 0.0


def test_planning_z_and_rounds_for_a_target():
    q, delta = 0.05, 1e-5
    z = noise_for_target(4.0, delta, q, 200)
    assert epsilon_for([(z, q, 200)], delta) <= 4.0 < epsilon_for([(z * 0.95, q, 200)], delta)
    t = rounds_for_target(4.0, delta, q, 1.0)
    assert t >= 1 and epsilon_for([(1.0, q, t)], delta) <= 4.0 < epsilon_for([(1.0, q, t + 1)], delta)
    assert rounds_for_target(0.01, delta, 1.0, 0.5) == 0


def test_ledger_round_trip_recomposes_the_same_epsilon():
    """A restart reads the checkpoint's ledger and goes on: neither forgetting nor double-counting."""
    delta = 1e-5
    whole = Ledger()
    for r in range(12):
        whole.compose(1.2, 0.1 if r < 5 else 0.08)  # the cohort shrank after round 5
    first = Ledger()
    for _ in range(7):
        first.compose(1.2, 0.1 if _ < 5 else 0.08)
    restored = Ledger.from_state(first.state())  # the checkpoint's JSON
    for _ in range(5):
        restored.compose(1.2, 0.08)
    assert restored.history == whole.history == [(1.2, 0.1, 5), (1.2, 0.08, 7)]
    assert restored.rounds == 12 and restored.epsilon(delta) == whole.epsilon(delta)
    for bad in ([[1.0, 0.0, 1]], [[1.0, 0.1]], [["a", 0.1, 1]], [[1.0, 0.1, 0]]):
        with pytest.raises(LedgerError):
            Ledger.from_state(bad)


def test_target_epsilon_stops_the_simulation_at_the_right_round(digits):
    part = make_partition(digits.y, 10, 10, "dir0.5", seed=3, samples=300)
    clients = [client_data(digits, c) for c in part.clients]
    z, target = 1.0, 1.5
    asked = len(select_clients(10, 0.3, 2, 1))
    q, delta = asked / 10, 10 ** -1.1
    expected = rounds_for_target(target, delta, q, z)
    assert 1 <= expected < 8
    res = simulate(make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05, device="cpu")), clients,
                   rounds=8, seed=2, join_ratio=0.3,
                   privacy=PrivacySettings(enabled=True, noise_multiplier=z, target_epsilon=target))
    assert len(res.rounds) == expected
    assert res.epsilon is not None and res.epsilon <= target
    assert res.budget_stop is not None and f"round {expected + 1} would bring epsilon" in res.budget_stop
    assert res.epsilon == pytest.approx(epsilon_for([(z, q, expected)], delta))
