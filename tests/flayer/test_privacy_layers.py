"""Per-layer clip bounds (``[privacy] clip_split``, flayer.engine.privacy.clip_upload): every layer i clipped to
C_i with sum_i C_i^2 = C^2, so the clipped upload's norm never exceeds C (the sensitivity the accountant prices)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flayer.config import ConfigError, from_mapping
from flayer.engine.privacy import RoundPrivacy, clip_upload, layer_bounds, layer_of, privatize, upload_norm
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update

SHAPES = {"conv1.0.weight": 800, "conv1.0.bias": 32, "conv2.0.weight": 51_200, "conv2.0.bias": 64,
          "fc1.0.weight": 20_000, "fc1.0.bias": 512}


def _update(rng: np.random.Generator, scales: dict[str, float], sparse: bool = False) -> Update:
    deltas = {}
    for k, n in SHAPES.items():
        if sparse:  # a public share of positions, as FLAYER's private rounds upload
            idx = np.sort(rng.choice(n, size=max(1, n // 4), replace=False)).astype(np.int64)
            deltas[k] = TensorDelta((n,), (rng.standard_normal(idx.size) * scales.get(k, 1.0)).astype(np.float32), idx)
        else:
            deltas[k] = TensorDelta((n,), (rng.standard_normal(n) * scales.get(k, 1.0)).astype(np.float32))
    return Update(deltas, 10, {})


@pytest.mark.parametrize("split", ["sqrt", "equal"])
def test_the_layer_bounds_spend_exactly_c_squared(split: str) -> None:
    up = _update(np.random.default_rng(0), {})
    bounds = layer_bounds(up, 0.3, split)
    assert set(bounds) == {"conv1.0", "conv2.0", "fc1.0"} and layer_of("fc1.0.bias") == "fc1.0"
    assert sum(c * c for c in bounds.values()) == pytest.approx(0.09, rel=1e-12)
    if split == "sqrt":  # every uploaded coordinate gets the same share C^2 / n
        n = sum(SHAPES.values())
        assert bounds["conv2.0"] == pytest.approx(0.3 * math.sqrt((51_200 + 64) / n))


@pytest.mark.parametrize("split", ["sqrt", "equal"])
@pytest.mark.parametrize("sparse", [False, True])
def test_no_update_comes_out_above_c_whatever_it_holds(split: str, sparse: bool) -> None:
    """Honest-sized, huge, and lopsided updates (all the mass on one layer, or the mass spread to fill every C_i):
    the clipped norm is at most C, and each layer at most its C_i."""
    rng = np.random.default_rng(1)
    clip = 0.3
    cases = [{}, {k: 1e6 for k in SHAPES}, {"conv1.0.bias": 1e9}, {"fc1.0.weight": 1e3, "conv1.0.weight": 1e-9},
             {k: 1e-6 for k in SHAPES}]
    for scales in cases:
        up = _update(rng, scales, sparse)
        out, norm = clip_upload(up, clip, split)
        assert norm == pytest.approx(upload_norm(up))
        assert upload_norm(out) <= clip, (scales, upload_norm(out))
        bounds = layer_bounds(up, clip, split)
        for layer, c_i in bounds.items():
            sq = sum(float(np.dot(d.values.astype(np.float64), d.values.astype(np.float64)))
                     for k, d in out.deltas.items() if layer_of(k) == layer)
            assert math.sqrt(sq) <= c_i
    # an update that fills every layer's bound reaches C itself (the split wastes none of it)
    full = _update(rng, {k: 1e3 for k in SHAPES}, sparse)
    assert upload_norm(clip_upload(full, clip, split)[0]) == pytest.approx(clip, rel=1e-5)


def test_a_small_update_is_left_alone_and_total_is_todays_clip() -> None:
    up = _update(np.random.default_rng(2), {k: 1e-7 for k in SHAPES})
    assert clip_upload(up, 0.3, "sqrt")[0] is up
    big = _update(np.random.default_rng(3), {k: 1.0 for k in SHAPES})
    total, _ = clip_upload(big, 0.3, "total")
    ratio = {k: float(total.deltas[k].values[0] / big.deltas[k].values[0]) for k in SHAPES}
    assert max(ratio.values()) == pytest.approx(min(ratio.values()), rel=1e-5)  # one scale: the direction kept


def test_the_split_travels_in_the_plan_and_privatize_uses_it() -> None:
    s = PrivacySettings(enabled=True, clip=0.3, noise_multiplier=1.0, clip_split="sqrt").resolve(100, 20)
    rp = RoundPrivacy.of(s)
    assert rp.clip_split == "sqrt" and RoundPrivacy.from_plan(rp.as_plan()) == rp
    assert PrivacySettings().clip_split == "sqrt"  # the default (docs/results/privacy.md, "The clip's cost")
    plain = RoundPrivacy.of(PrivacySettings(enabled=True, clip=0.3, noise_multiplier=1.0, clip_split="total")
                            .resolve(100, 20))
    assert "clip_split" not in plain.as_plan()  # one bound: the plans of earlier releases, unchanged
    assert RoundPrivacy.from_plan(plain.as_plan()).clip_split == "total"  # a plan without the key: one bound
    with pytest.raises(ValueError, match="out of range"):
        RoundPrivacy.from_plan({**rp.as_plan(), "clip_split": "none"})
    up = _update(np.random.default_rng(4), {"conv1.0.weight": 100.0})
    out = privatize(up, rp, None)
    want, _ = clip_upload(up, 0.3, "sqrt")
    for k in SHAPES:
        np.testing.assert_array_equal(out.deltas[k].values, want.deltas[k].values)


def test_an_unknown_split_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"\[privacy\]\.clip_split: expected one of 'total', 'sqrt', 'equal'"):
        from_mapping(PrivacySettings, {"clip_split": "layer"}, "[privacy]")
    with pytest.raises(ValueError, match="clip_split must be one of total, sqrt, equal"):
        PrivacySettings(clip_split="layer")  # type: ignore[arg-type]
