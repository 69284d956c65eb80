"""Banded correlated noise (flayer.engine.correlated, docs/explanation/privacy.md "Correlated noise"): the
coefficients and the sensitivity against jax-privacy 2.0, the stream against a direct solve of C w = z, its
saved state, and the settings it refuses.

The reference values in ``data/banded_toeplitz_jax_privacy.json`` were computed with jax-privacy 2.0.0 (jax
0.10.2, x64) by REFERENCE_SCRIPT below; jax-privacy is not a test dependency (it pulls about 140 MB of jax and
jaxlib wheels)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest

from flayer.config import ConfigError, from_mapping
from flayer.engine.correlated import (
    BandedNoise,
    NoiseStateError,
    coefficients,
    coefficients_digest,
    minsep_sensitivity_squared,
    optimize_banded,
    plan_fields,
    prefix_errors,
)
from flayer.privacy_config import PrivacySettings

REFERENCE = Path(__file__).parent / "data" / "banded_toeplitz_jax_privacy.json"
REFERENCE_SCRIPT = """
import json, jax; jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
from jax_privacy.matrix_factorization import toeplitz
out = []
for n, b, k in [(10, 5, 2), (20, 5, 4), (20, 10, 2), (100, 5, 20)]:
    coef, ident = toeplitz.optimize_banded_toeplitz(n, b), jnp.array([1.0])
    out.append({"n": n, "bands": b, "min_sep": b, "k": k, "coef": [float(c) for c in coef],
                "sens2": float(toeplitz.minsep_sensitivity_squared(coef, b, k, n)),
                "sens2_independent": float(toeplitz.minsep_sensitivity_squared(ident, b, k, n)),
                "mean_error": float(jnp.mean(toeplitz.per_query_error(strategy_coef=coef, n=n))),
                "mean_error_independent": float(jnp.mean(toeplitz.per_query_error(strategy_coef=ident, n=n))),
                "last_error": float(toeplitz.per_query_error(strategy_coef=coef, n=n)[-1])})
print(json.dumps(out, indent=1))
"""
CASES = json.loads(REFERENCE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c['n']}-b{c['bands']}-k{c['k']}")
def test_coefficients_and_sensitivity_match_jax_privacy(case):
    n, bands, k = case["n"], case["bands"], case["k"]
    coef = optimize_banded(n, bands)
    assert np.allclose(coef, case["coef"], atol=1e-6)
    assert abs(np.linalg.norm(coef) - 1) < 1e-12 and coef[0] > 0
    errors = prefix_errors(coef, n)
    assert errors.mean() == pytest.approx(case["mean_error"], rel=1e-6)
    assert errors[-1] == pytest.approx(case["last_error"], rel=1e-6)
    assert prefix_errors([1.0], n).mean() == pytest.approx(case["mean_error_independent"])
    assert minsep_sensitivity_squared(coef, case["min_sep"], k, n) == pytest.approx(case["sens2"], rel=1e-9)
    assert minsep_sensitivity_squared([1.0], case["min_sep"], k, n) == pytest.approx(case["sens2_independent"])
    # what it buys: at equal sensitivity the prefix sums carry less noise (0.62x the RMSE at n=20, bands 5)
    assert np.sqrt(case["mean_error"] / case["mean_error_independent"]) < 0.75


def test_sensitivity_is_refused_where_one_devices_rounds_share_rows():
    with pytest.raises(ValueError, match="bands 5 > min_separation 3"):
        minsep_sensitivity_squared(coefficients(20, 5), 3, 4, 20)
    # fewer rounds than k fit: only the reachable columns count (rounds 0, 5, 10, 15 of 20)
    assert minsep_sensitivity_squared(coefficients(20, 5), 5, 10, 20) == pytest.approx(4.0)


class _Fixed:
    """A generator replaying given z vectors (the test knows every z_t)."""

    def __init__(self, zs: list[np.ndarray]) -> None:
        self.zs = list(zs)

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: int | None = None) -> np.ndarray:
        return self.zs.pop(0)


def _strategy_matrix(coef: np.ndarray, n: int) -> np.ndarray:
    c = np.zeros((n, n))
    for i, v in enumerate(coef):
        c += np.diag(np.full(n - i, v), -i)
    return c


def test_the_stream_solves_c_w_equals_z_row_by_row():
    n, dim = 12, 7
    coef = coefficients(n, 4)
    zs = [np.random.default_rng(i).normal(0, 2.0, dim) for i in range(n)]
    stream = BandedNoise(coef, 2.0, dim)
    w = np.stack([stream.draw(_Fixed([z])) for z in zs])
    assert np.allclose(_strategy_matrix(coef, n) @ w, np.stack(zs), atol=1e-12)
    assert stream.step == n and len(stream.history) == 3


def test_the_streams_covariance_and_prefix_sums():
    """Drawn from the CSPRNG: each w_t's variance is sigma^2 (C^-1 C^-T)_tt >= sigma^2 (no round is less noised
    than independent noise's), and the prefix sums' mean variance is the optimised 0.38x of independent's."""
    from flayer.secagg.prg import KeystreamRandom

    n, dim, sigma = 20, 20000, 1.5
    coef = coefficients(n, 5)
    stream, rng = BandedNoise(coef, sigma, dim), KeystreamRandom()
    w = np.stack([stream.draw(rng) for _ in range(n)])
    inv = np.linalg.inv(_strategy_matrix(coef, n))
    expected = sigma ** 2 * np.diag(inv @ inv.T)
    assert np.allclose(w.var(axis=1), expected, rtol=0.05)
    assert (w.var(axis=1) > 0.95 * sigma ** 2).all()
    prefix = np.cumsum(w, axis=0).var(axis=1).mean() / sigma ** 2
    assert prefix == pytest.approx(prefix_errors(coef, n).mean(), rel=0.05)
    assert prefix < 0.45 * (n + 1) / 2


def test_a_saved_state_continues_the_same_stream(tmp_path):
    n, dim = 10, 5
    coef = coefficients(n, 3)
    zs = [np.random.default_rng(10 + i).normal(0, 1.0, dim) for i in range(n)]
    whole = BandedNoise(coef, 1.0, dim)
    ref = [whole.draw(_Fixed([z])) for z in zs]
    first = BandedNoise(coef, 1.0, dim)
    for z in zs[:4]:
        first.draw(_Fixed([z]))
    path = first.save(tmp_path / "noise.state")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = BandedNoise.load(path, coef, 1.0, dim)
    assert again.step == 4
    rest = [again.draw(_Fixed([z])) for z in zs[4:]]
    assert all(np.array_equal(a, b) for a, b in zip(rest, ref[4:]))
    with pytest.raises(NoiseStateError, match="other coefficients"):
        BandedNoise.load(path, coefficients(n, 4)[:3] / np.linalg.norm(coefficients(n, 4)[:3]), 1.0, dim)
    with pytest.raises(NoiseStateError, match="another noise std"):
        BandedNoise.load(path, coef, 2.0, dim)
    with pytest.raises(NoiseStateError, match="does not fit"):
        BandedNoise.load(path, coef, 1.0, dim + 1)
    (tmp_path / "bad").write_bytes(b"not a state")
    with pytest.raises(NoiseStateError, match="unreadable"):
        BandedNoise.load(tmp_path / "bad", coef, 1.0, dim)


def test_the_plan_names_kind_bands_and_digest_only():
    coef = coefficients(20, 5)
    fields = plan_fields(coef)
    assert fields == {"noise": "banded", "bands": 5, "noise_digest": coefficients_digest(coef)}
    assert len(fields["noise_digest"]) == 64
    with pytest.raises(ValueError, match="unit norm"):
        BandedNoise(coef * 2, 1.0, 3)


@pytest.mark.parametrize("bad, needle", [
    ({"noise_kind": "banded", "noise_bands": 5}, "needs a participation schema"),
    ({"noise_kind": "banded", "noise_bands": 5, "max_participations": 4, "min_separation": 3}, "min_separation >= 5"),
    ({"noise_kind": "banded", "noise_bands": 5, "max_participations": 4, "min_separation": 5, "mode": "local"},
     "needs mode = \"central\" without secure aggregation"),
    ({"noise_kind": "banded", "noise_bands": 5, "max_participations": 4, "min_separation": 5,
      "secure_aggregation": True}, "without secure aggregation"),
    ({"noise_kind": "banded", "noise_bands": 5, "max_participations": 4, "min_separation": 5,
      "clipping": "adaptive"}, "clipping = \"fixed\""),
    ({"noise_kind": "pink"}, "noise_kind: expected one of"),
    ({"noise_bands": 0}, "noise_bands must be an integer"), ({"noise_bands": 65}, "noise_bands must be an integer"),
])
def test_banded_noise_without_its_schema_or_with_shared_noise_is_refused(bad, needle):
    with pytest.raises(ConfigError, match="privacy") as exc:
        from_mapping(PrivacySettings, {"enabled": True, **bad}, "[privacy]")
    assert needle in str(exc.value)


def test_banded_noise_with_its_schema_is_accepted():
    s = PrivacySettings(enabled=True, noise_kind="banded", noise_bands=5, max_participations=4, min_separation=5)
    assert s.banded and s.correlated_problem() is None
    assert not PrivacySettings(enabled=True, noise_kind="banded", noise_bands=1).banded  # one band: independent


def test_the_cli_refuses_banded_noise_without_its_schema_in_one_line(capsys):
    from cli.main import main

    assert main(["simulate", "--dataset", "digits", "--clients", "4", "--rounds", "2", "--dp", "central",
                 "--dp-noise-kind", "banded", "--dp-bands", "5", "--max-participations", "2", "--min-separation",
                 "3"]) == 2
    err = capsys.readouterr().err
    assert "min_separation >= 5" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_coordinator_refuses_banded_noise(digits):
    from coordinator.privacy import FederationPrivacy
    from flayer.config import TrainConfig
    from flayer.strategies import make_strategy

    strategy = make_strategy("fedavg", digits.model_spec(), TrainConfig(lr=0.05, batch_size=10, device="cpu"))
    s = PrivacySettings(enabled=True, population=100, noise_kind="banded", noise_bands=5, max_participations=4,
                        min_separation=5)
    with pytest.raises(ValueError, match="runs in flayer simulate only"):
        FederationPrivacy.of(s, strategy, quorum=10, buffer=10, asynchronous=False)
