"""An empirical privacy audit of central DP (docs/results/privacy-audit.md), as each adversary would run it.

A canary device takes part in every round of a small private federation (``flayer simulate``'s engine) and
uploads a fixed large direction, clipped to C, or, in the neighbouring world, nothing. Two adversaries score
each run from their own view (:mod:`flayer.audit.canary`): a reader of the published models (the last
model's change projected on the canary's direction), and a device or broker observer, which also reads the
round plans and with them the run seed, regenerates the noise a seed-derived draw would have added, and
subtracts it. Many runs give false-positive and false-negative rates, and Clopper-Pearson turns them into
an epsilon lower bound at 95% confidence (Jagielski et al. 2020). The guarantee holds when no adversary's
lower bound reaches the accountant's epsilon for the same settings; noise a plan reader can regenerate
drives the plan reader's bound to what the trials can show at all (log of about the trial count), far above.
The one-run estimate (Andrew et al. 2023) puts many random canary devices into one run and reads their
cosines with the model's change.
"""

from __future__ import annotations

import pytest

from flayer.audit import AuditFederation, audit_trials, one_run_estimate
from flayer.engine.accountant import noise_for_target

DELTA = 1e-5


def _federation(target: float, rounds: int = 1, canaries: int = 1) -> AuditFederation:
    z = noise_for_target(target, DELTA, 1.0, rounds)  # the accountant's z for this epsilon at q = 1
    return AuditFederation(trainers=2, canaries=canaries, rounds=rounds, noise_multiplier=z, delta=DELTA)


def _below(audit) -> None:  # type: ignore[no-untyped-def]
    for adversary, bound in audit.bounds.items():
        assert bound.epsilon < audit.accountant, (
            f"{adversary}: the audit's lower bound {bound.epsilon:.3f} (FPR {bound.fpr:.3f}, FNR {bound.fnr:.3f} over "
            f"{bound.certified_in}+{bound.certified_out} certified trials, {bound.confidence:.0%} confidence) "
            f"reaches the accountant's epsilon {audit.accountant:.3f}: the published models leak more than it says")


def test_no_adversary_bounds_epsilon_above_the_accountant():
    audit = audit_trials(_federation(0.5), trials=25, seed=1)
    assert audit.accountant == pytest.approx(0.5, rel=0.02)
    _below(audit)


def test_one_run_canary_estimate_stays_near_the_accountant():
    fed = _federation(1.0, rounds=2, canaries=40)
    est = one_run_estimate(fed, seed=2, unobserved=400)
    # the null check: directions that took no part have cosines of mean 0 and spread 1/sqrt(d)
    for adversary in est.estimate:
        assert abs(est.unobserved_mean[adversary]) < 4 * est.null_std / 20
        assert est.unobserved_std[adversary] == pytest.approx(est.null_std, rel=0.2)
    # an estimate, not a bound: 4x the accountant's epsilon is about 5 standard errors of the mean cosine away
    for adversary, value in est.estimate.items():
        assert value < 4 * est.accountant, (
            f"{adversary}: one-run estimate {value:.2f} against the accountant's {est.accountant:.2f} (canary mean "
            f"cosine {est.canary_mean[adversary]:.4f}, null spread {est.null_std:.4f})")


@pytest.mark.slow
def test_seeded_noise_lets_the_plan_reader_bound_epsilon_far_above():
    """The audit's power: ``flayer simulate --dp-seeded-noise`` (labelled not private) draws the noise from the
    run seed the plans carry; the plan reader's replay separates the worlds and its bound passes the
    accountant's several times over (105 certified trials a world cap it at 3.3), while the models reader's
    stays below."""
    fed = _federation(1.0)
    seeded = audit_trials(fed, trials=150, seed=3, seeded_noise=True)
    assert seeded.bounds["plans"].epsilon > 2.5 * seeded.accountant, seeded.bounds["plans"]
    assert seeded.bounds["models"].epsilon < seeded.accountant
    shipped = audit_trials(fed, trials=150, seed=4)
    _below(shipped)
    one = one_run_estimate(_federation(1.0, rounds=2, canaries=40), seed=5, unobserved=400, seeded_noise=True)
    assert one.estimate["plans"] > 20 * one.accountant
