"""Every private mechanism, audited against the accountant that prices it (docs/results/privacy-audit.md, "Every
mechanism, with power"; docs/explanation/privacy.md).

The adversary is the auditor the privacy page invites: it may choose any setting the project accepts, runs a
canary device's clipped upload against its zero-out neighbour through the code the drivers run
(:mod:`flayer.audit.mechanism`: the device's privatize, the coordinator's re-clip, the noised fixed-denominator sum
from the CSPRNG, the adaptive clip update, the in-process secure protocol) and reads only what its adversary
reads (the next model and C; in local mode, for the coordinator, the canary's upload). The guarantee: no lower
bound it can certify -- the Clopper-Pearson bound, or the 4-sigma Gaussian-DP bound for these Gaussian releases
-- rises above the epsilon the project's own ledger (:class:`flayer.engine.adversaries.Accounts`) composes for
that round. And the audit has the power to see a mistake: a mechanism that draws half the noise its plan names
fails it.
"""

from __future__ import annotations

import math

import pytest

from flayer.audit.mechanism import (
    MECHANISMS,
    SECURE_DISTRIBUTED_M,
    MechanismAudit,
    half_sensitivity_plan,
    mechanism_case,
    run_audit,
)
from flayer.engine.accountant import noise_for_target
from flayer.privacy_config import PrivacySettings

DELTA, M = 1e-5, 3
# the asynchronous twins (the same mode and clipping, through the version buffer's fixed-denominator sum) are
# slow: about 9 s each on a loaded 2-core machine; CI's slow step runs them
PLAIN = [pytest.param(n, marks=pytest.mark.slow) if spec[3] else n
         for n, spec in MECHANISMS.items() if not spec[2]]
SECURE = [n for n, spec in MECHANISMS.items() if spec[2]]


def _z(name: str, target: float) -> float:
    z = noise_for_target(target, DELTA, 1.0, 1)
    return z * math.sqrt(M) if MECHANISMS[name][4] == "coordinator" else z


def _holds(a: MechanismAudit) -> str | None:
    """None when neither bound rises above the accountant's epsilon, else what the audit certified."""
    if a.bound.epsilon > a.claimed or a.gdp_lower > a.claimed:
        return (f"{a.name} ({a.adversary}): the accountant says {a.claimed:.3f}; the audit certifies "
                f"{a.bound.epsilon:.3f} (Clopper-Pearson) and {a.gdp_lower:.3f} (4-sigma Gaussian-DP), estimate "
                f"{a.gdp_estimate:.3f}")
    return None


def test_adaptive_clipping_spends_no_more_than_its_accountant_says() -> None:
    """The settings an operator may write, the issue's among them (z 1.8985 at count_stddev 1, m 20's default
    m / 20). Each is refused by the project, or audited: its bound must stay under what the ledger composes."""
    audited, refused = [], []
    for z, sigma_b in ((1.8985, 1.0), (1.5, 1.0), (0.9, 1.0), (1.8985, None)):
        try:
            trial = mechanism_case("adaptive", z, M, count_stddev=sigma_b)
        except ValueError as exc:
            refused.append((z, sigma_b, str(exc)))
            continue
        audit = run_audit(trial, 4000)
        audited.append(audit)
        assert _holds(audit) is None, _holds(audit)
    assert len(audited) >= 2, f"nothing was audited (refused: {refused})"


@pytest.mark.parametrize("name", PLAIN)
def test_each_mechanism_stays_under_its_accountant_and_a_mis_accounted_twin_does_not(name: str) -> None:
    honest = run_audit(mechanism_case(name, _z(name, 4.0), M), 4000)
    assert _holds(honest) is None, _holds(honest)
    assert honest.gdp_estimate > honest.claimed / 2, f"the audit sees nothing of {name}: {honest.as_dict()}"
    twin = run_audit(mechanism_case(name, _z(name, 2.0), M, noise_scale=0.5), 4000)
    assert _holds(twin) is not None, f"the audit missed a mechanism drawing half its noise: {twin.as_dict()}"


def test_the_audit_catches_the_half_sensitivity_adaptive_rule() -> None:
    """A plan whose update noise assumes the clip bits move the count by 1/2 (labelled z 1.8985, count_stddev 1) is
    caught against the label's epsilon: what a ledger that composes labels would print."""
    from flayer.engine.accountant import epsilon_for

    trial = mechanism_case("adaptive", 1.8985, M, rp_of=lambda s: half_sensitivity_plan(s, 1.0))
    audit = run_audit(trial, 4000, claimed=epsilon_for([(1.8985, 1.0, 1)], DELTA))
    assert _holds(audit) is not None, audit.as_dict()
    # the project's own ledger composes what the plan names, and so prices the same plan honestly
    honest = run_audit(trial, 4000)
    assert _holds(honest) is None, _holds(honest)


def test_the_settings_refuse_clip_bit_noise_at_or_below_z() -> None:
    with pytest.raises(ValueError, match="below count_stddev"):
        PrivacySettings(enabled=True, clipping="adaptive", noise_multiplier=1.8985, count_stddev=1.0).resolve(100, 20)


@pytest.mark.slow
@pytest.mark.parametrize("name", SECURE)
def test_secure_rounds_stay_under_their_accountant_and_a_twin_does_not(name: str) -> None:
    m = SECURE_DISTRIBUTED_M if name == "secure-distributed" else M  # drops to t survivors: the worst case
    honest = run_audit(mechanism_case(name, _z(name, 4.0), m), 800)
    assert _holds(honest) is None, _holds(honest)
    twin = run_audit(mechanism_case(name, _z(name, 2.0), m, noise_scale=0.5), 800)
    assert _holds(twin) is not None, f"the audit missed a secure round drawing half its noise: {twin.as_dict()}"
