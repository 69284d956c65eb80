"""Banded correlated noise, audited over a whole run against the ledger that prices it
(docs/results/privacy-audit.md, "Banded noise, over a run"; docs/explanation/privacy.md, "Correlated noise").

The adversary reads every published model of a ``--dp-noise-kind banded`` run (:mod:`flayer.audit.banded`: the
simulator's stream from the CSPRNG, the device's clip at the shipped per-layer split, the coordinator's re-clip,
the noised sum) and knows every upload but a canary device's; it scores the run with the Neyman-Pearson
statistic of ``C y = C x + z`` over the public coefficients. The guarantee: with the canary in rounds the
participation schema allows, no bound it can certify rises above the k-fold epsilon the run's ledger composes.
And the audit has the power to see a sensitivity error: the same canary in rounds the min-separation forbids
(what a regression of that refusal would let through), or a stream drawing half its named noise, fails it.
"""

from __future__ import annotations

import pytest

from flayer.audit.banded import BANDED_MOST, banded_case, run_banded_audit
from flayer.audit.mechanism import MechanismAudit
from flayer.engine.accountant import noise_for_target
from flayer.privacy_config import PrivacySettings

DELTA = 1e-5
# 1000 runs a world: the overlapping canary's 4-sigma Gaussian-DP bound sits ~4.5 standard errors above the claim
# (an honest run raises a false alarm about 3 times in 100,000); each run is 9 rounds (~3.5 ms)
TRIALS = 1000


def _z(target: float) -> float:
    return noise_for_target(target, DELTA, 1.0, BANDED_MOST)  # the schema's k-fold composition at q = 1


def _caught(a: MechanismAudit) -> bool:
    return a.bound.epsilon > a.claimed or a.gdp_lower > a.claimed


def test_a_banded_run_stays_under_its_ledger_and_overlapping_rounds_do_not() -> None:
    z = _z(8.0)
    honest = run_banded_audit(banded_case(z, "honest"), TRIALS)
    assert abs(honest.claimed - 8.0) < 0.05, honest.as_dict()  # the ledger books the k-fold composition
    assert not _caught(honest), f"a banded run certified above its ledger: {honest.as_dict()}"
    assert honest.gdp_estimate > honest.claimed / 2, f"the audit sees nothing of the banded run: {honest.as_dict()}"
    overlap = run_banded_audit(banded_case(z, "overlap"), TRIALS)
    assert _caught(overlap), f"the audit missed a canary in rounds the separation forbids: {overlap.as_dict()}"


def test_a_banded_stream_drawing_half_its_noise_is_caught() -> None:
    twin = run_banded_audit(banded_case(_z(2.0), "half-noise"), 400)
    assert twin.noise_scale == 0.5
    assert _caught(twin), f"the audit missed a banded stream drawing half its noise: {twin.as_dict()}"


def test_the_audits_canary_rounds_are_the_schemas() -> None:
    """The honest canary's rounds pass the schema's own rule and the overlapping ones do not (else the rows would
    audit something other than what they name); settings whose separation is under the bands are refused."""
    honest, overlap = banded_case(1.0, "honest"), banded_case(1.0, "overlap")
    schema = honest.trial.settings.schema
    assert honest.canary_rounds == (0, 3, 6) and overlap.canary_rounds == (0, 1, 2)
    assert schema.refuses([0], 1) is not None and schema.refuses([0], 3) is None
    with pytest.raises(ValueError, match="min_separation >= 3"):
        PrivacySettings(enabled=True, noise_kind="banded", noise_bands=3, max_participations=3, min_separation=2)
