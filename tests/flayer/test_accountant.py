"""The privacy accountant (flayer.engine.accountant): epsilon for known-sample (q = 1), Poisson and fixed-size
selection against Google's dp-accounting (RDP and PLD), computed here independently; planning z and rounds
for a target; the ledger's checkpoint round trip; a target epsilon that stops a simulation at the right round."""

from __future__ import annotations

import itertools
import math

import pytest

from flayer.config import TrainConfig
from flayer.engine.accountant import (
    Ledger,
    LedgerError,
    epsilon_fixed_size,
    epsilon_for,
    gaussian_epsilon,
    noise_for_target,
    rounds_for_target,
)
from flayer.partition import make_partition
from flayer.privacy_config import PrivacySettings, default_delta
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data

dpa = pytest.importorskip("dp_accounting")
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant


def _pld(event, delta: float) -> float:
    return float(pld_privacy_accountant.PLDAccountant().compose(event).get_epsilon(delta))


def _rdp(event, delta: float, relation=None) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation or dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return float(acc.compose(event).get_epsilon(delta))


def _gaussian_delta(eps: float, z: float) -> float:
    """Balle and Wang 2018, Thm 8, written out here with math.erfc."""
    mu = 1 / z

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)


# the settings of docs/results/privacy.md: 100 devices, 20 a round, 10 rounds; the noise the old accountant
# chose for "epsilon 8", "4" and "1" (Poisson at q = 0.2, delta 1/N^1.1), and the delta now used
@pytest.mark.parametrize("z, rounds, delta", [(0.607, 10, 0.0063), (0.856, 10, 0.0063), (1.855, 10, 1e-5),
                                             (1.28, 10, 0.037), (3.0, 200, 1e-5)])
def test_known_sample_epsilon_is_the_exact_gaussian_composition(z, rounds, delta):
    """The cohort is public: each round at q = 1. T rounds at z are one Gaussian mechanism at z / sqrt(T);
    the accountant's figure is its exact epsilon, the PLD's within discretisation, never above RDP's."""
    ours = epsilon_for([(z, 1.0, rounds)], delta)
    event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), rounds)
    assert ours == pytest.approx(_pld(event, delta), rel=1e-3)
    assert ours <= _rdp(event, delta)
    assert _gaussian_delta(ours, z / math.sqrt(rounds)) == pytest.approx(delta, rel=1e-6)
    assert gaussian_epsilon(z / math.sqrt(rounds), delta) == pytest.approx(ours, rel=1e-9)


def test_the_results_pages_old_noise_spends_what_the_review_recomputed():
    """z 0.607 ("epsilon 8" under Poisson q = 0.2) is 25.75 once the sample is known; z 0.856 ("4") 15.28."""
    assert epsilon_for([(0.607, 1.0, 10)], 0.0063) == pytest.approx(25.75, abs=0.01)
    assert epsilon_for([(0.856, 1.0, 10)], 0.0063) == pytest.approx(15.28, abs=0.01)


def test_rounds_of_different_noise_compose_exactly():
    """Local rounds closed short carry less noise: (z_i) compose to one Gaussian at (sum z_i^-2)^(-1/2)."""
    runs = [(1.0, 1.0, 3), (1.0 / math.sqrt(2), 1.0, 2), (2.0, 1.0, 1)]
    event = dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), n) for z, _, n in runs])
    assert epsilon_for(runs, 1e-5) == pytest.approx(_pld(event, 1e-5), rel=1e-3)
    assert epsilon_for(runs, 1e-5) > epsilon_for([(1.0, 1.0, 6)], 1e-5)


@pytest.mark.parametrize("q, z, t, delta", [(0.2, 0.607, 10, 0.0063), (0.1, 1.0, 50, 1e-4), (0.01, 1.1, 300, 1e-5)])
def test_poisson_sampling_is_dp_accountings_pld(q, z, t, delta):
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), t)
    ours = epsilon_for([(z, q, t)], delta)
    assert ours == pytest.approx(_pld(event, delta), rel=1e-6)
    assert ours <= _rdp(event, delta) + 1e-9  # PLD is the tighter of the two
    assert ours < epsilon_for([(z, 1.0, t)], delta)  # amplification, where the sample is secret


@pytest.mark.parametrize("n, m, z, t, delta", [(100, 20, 0.607, 10, 0.0063), (100, 20, 1.0, 10, 1e-5),
                                               (1000, 50, 1.2, 100, 1e-6)])
def test_a_secret_fixed_size_cohort_is_dp_accountings_replace_one_rdp(n, m, z, t, delta):
    event = dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(z)), t)
    ours = epsilon_fixed_size(n, m, z, t, delta)
    assert ours == pytest.approx(_rdp(event, delta, dpa.NeighboringRelation.REPLACE_ONE), rel=1e-9)
    assert ours < epsilon_for([(z, 1.0, t)], delta) * 2  # replace-one: at most the known sample's at 2C


def test_no_noise_is_an_infinite_epsilon_and_nothing_composed_is_zero():
    assert math.isinf(epsilon_for([(0.0, 1.0, 3)], 1e-5))
    assert math.isinf(epsilon_for([(0.0, 0.1, 3)], 1e-5))
    assert Ledger().epsilon(1e-5) == 0.0


def test_planning_z_and_rounds_for_a_target():
    delta = 1e-5
    z = noise_for_target(4.0, delta, 1.0, 20)
    assert epsilon_for([(z, 1.0, 20)], delta) <= 4.0 < epsilon_for([(z * 0.99, 1.0, 20)], delta)
    t = rounds_for_target(4.0, delta, 1.0, 3.0)
    assert t >= 1 and epsilon_for([(3.0, 1.0, t)], delta) <= 4.0 < epsilon_for([(3.0, 1.0, t + 1)], delta)
    assert rounds_for_target(0.01, delta, 1.0, 0.5) == 0


def test_ledger_round_trip_recomposes_the_same_epsilon():
    """A restart reads the checkpoint's ledger and goes on: neither forgetting nor double-counting."""
    delta = 1e-5
    whole = Ledger()
    for r in range(12):
        whole.compose(1.2 if r < 5 else 0.9)  # local rounds that closed short carry less noise
    first = Ledger()
    for r in range(7):
        first.compose(1.2 if r < 5 else 0.9)
    restored = Ledger.from_state(first.state())  # the checkpoint's JSON
    for _ in range(5):
        restored.compose(0.9)
    assert restored.history == whole.history == [(1.2, 1.0, 5), (0.9, 1.0, 7)]
    assert restored.rounds == 12 and restored.epsilon(delta) == whole.epsilon(delta)
    for bad in ([[1.0, 0.0, 1]], [[1.0, 0.1]], [["a", 0.1, 1]], [[1.0, 0.1, 0]]):
        with pytest.raises(LedgerError):
            Ledger.from_state(bad)


def test_target_epsilon_stops_the_simulation_at_the_right_round(digits):
    part = make_partition(digits.y, 10, 10, "dir0.5", seed=3, samples=300)
    clients = [client_data(digits, c) for c in part.clients]
    z, target = 2.0, 6.0
    delta = default_delta(10)
    expected = rounds_for_target(target, delta, 1.0, z)  # q = 1: the simulator's cohort is public too
    assert 1 <= expected < 8
    res = simulate(make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05, device="cpu")), clients,
                   rounds=8, seed=2, join_ratio=0.3,
                   privacy=PrivacySettings(enabled=True, noise_multiplier=z, target_epsilon=target))
    assert len(res.rounds) == expected
    assert res.epsilon is not None and res.epsilon <= target
    assert res.budget_stop is not None and f"round {expected + 1} would bring epsilon" in res.budget_stop
    assert res.epsilon == pytest.approx(epsilon_for([(z, 1.0, expected)], delta))
    assert res.epsilon_coordinator == math.inf  # central noise: no guarantee against the coordinator


def test_a_participation_schema_composes_the_k_least_noisy_rounds():
    """A device in at most k rounds: k-fold composition at a fixed z, the k smallest multipliers otherwise."""
    from flayer.engine.accountant import worst_rounds

    delta = 1e-5
    assert epsilon_for([(1.2, 1.0, 10)], delta, most=2) == epsilon_for([(1.2, 1.0, 2)], delta)
    assert epsilon_for([(1.2, 1.0, 1)], delta, most=5) == epsilon_for([(1.2, 1.0, 1)], delta)  # fewer rounds ran
    history = [(2.0, 1.0, 3), (0.9, 1.0, 1), (1.5, 1.0, 2)]
    assert worst_rounds(history, 2) == [(0.9, 1.0, 1), (1.5, 1.0, 1)]
    assert epsilon_for(history, delta, most=2) == epsilon_for([(0.9, 1.0, 1), (1.5, 1.0, 1)], delta)
    # any two rounds a device was in spend at most that
    assert all(epsilon_for([a, b], delta) <= epsilon_for(history, delta, most=2) + 1e-12
               for a in [(2.0, 1.0, 1), (0.9, 1.0, 1), (1.5, 1.0, 1)] for b in [(2.0, 1.0, 1), (1.5, 1.0, 1)])
    with pytest.raises(ValueError, match="q = 1"):
        epsilon_for([(1.0, 0.5, 3)], delta, most=1)
    z = noise_for_target(8.0, delta, 1.0, 10, most=3)
    assert epsilon_for([(z, 1.0, 10)], delta, most=3) <= 8.0 < epsilon_for([(z * 0.99, 1.0, 3)], delta)
    led = Ledger()
    led.compose(1.0, 1.0, 5)
    assert led.epsilon(delta, 2) == epsilon_for([(1.0, 1.0, 2)], delta)
    assert led.epsilon_after(0.5, 1.0, delta, 1, 2) == epsilon_for([(0.5, 1.0, 1), (1.0, 1.0, 1)], delta)


def test_the_schema_selection_is_a_public_rule_over_the_plans():
    """select_clients with a schema: deterministic, never a device past k or within b, from the cohorts alone."""
    from flayer.engine.selection import eligible, participations, select_clients
    from flayer.privacy_config import ParticipationSchema

    schema = ParticipationSchema(2, 3)
    taken: dict[int, list[int]] = {}
    cohorts = []
    for r in range(1, 13):
        sel = select_clients(30, 0.2, 7, r, schema, taken)
        assert sel == select_clients(30, 0.2, 7, r, schema, taken)  # the same public facts, the same cohort
        assert all(schema.refuses(taken.get(c, []), r) is None for c in sel)
        cohorts.append((r, sel))
        for c in sel:
            taken.setdefault(c, []).append(r)
    assert participations(cohorts) == taken  # anyone holding the plans rebuilds the history
    assert all(len(rs) <= 2 and all(b - a >= 3 for a, b in itertools.pairwise(rs)) for rs in taken.values())
    assert eligible([1, 2, 3], {1: [5], 2: [1, 4]}, schema, 7) == [3]
    assert [len(s) for _, s in cohorts][:5] == [6] * 5 and len(cohorts[-1][1]) < 6  # fewer once few are left


def test_a_void_round_counts_toward_separation_never_toward_max_participations():
    """The plans name a secure round abandoned before its unmasking in a later plan's secure.void: anyone holding the
    plans finds it (void_rounds) and counts no device's selection in it toward k; it still counts for b."""
    from flayer.engine.selection import eligible, participations, void_rounds
    from flayer.privacy_config import ParticipationSchema

    plans = [(1, "s1", ""), (2, "s2", ""), (3, "s3", "s1"), (4, None, "s1 s3 other")]
    assert void_rounds(plans) == {1, 3}
    history = participations([(1, ["a", "b"]), (2, ["c"]), (3, ["a"])])
    schema = ParticipationSchema(1, 2)
    assert eligible(["a", "b", "c"], history, schema, 5, void_rounds(plans)) == ["a", "b"]
    assert eligible(["a", "b", "c"], history, schema, 4, void_rounds(plans)) == ["b"]  # a: round 3 was 1 before
    assert eligible(["a", "b", "c"], history, schema, 5) == []  # every selection counted


@pytest.mark.parametrize("most, sep, needle", [(0, 0, "max_participations"), (True, 0, "max_participations"),
                                               (2, -1, "min_separation"), (2, 1.5, "min_separation")])
def test_a_malformed_schema_is_refused(most, sep, needle):
    from flayer.privacy_config import PrivacySettings

    with pytest.raises(ValueError, match=needle):
        PrivacySettings(enabled=True, max_participations=most, min_separation=sep)
