"""A secure upload fitted to the link (flayer.engine.secure_fit, coordinator.secure_fit): the public subset of the
common positions, the budget rule, the keep fraction, the settings, and one secure round on the kept positions."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edge_client import linkfit
from flayer.engine import secure_fit as sf
from flayer.engine.secure import plan_round, plan_secure, secure_from_plan, secure_sum
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.update import TensorDelta, Update


def _upload(rng: np.random.Generator, n: int = 400) -> Update:
    idx = np.arange(0, 2 * n, 2, dtype=np.int64)  # public positions of a sparse tensor
    return Update({"a.weight": TensorDelta((20, 30), rng.normal(0, 0.01, 600).astype(np.float32)),
                   "b.weight": TensorDelta((2 * n,), rng.normal(0, 0.01, n).astype(np.float32), idx)}, 1, {})


def test_the_kept_subset_is_public_per_round_and_the_layout_follows_it():
    up = _upload(np.random.default_rng(0))
    lay = layout_of(up)
    a, b = sf.kept_offsets(600, 0.25, 7, 3, "a.weight"), sf.kept_offsets(600, 0.25, 7, 3, "a.weight")
    assert a is not None and np.array_equal(a, b) and a.size == 150 and np.all(np.diff(a) > 0)
    assert not np.array_equal(a, sf.kept_offsets(600, 0.25, 7, 4, "a.weight"))  # drawn again each round
    assert not np.array_equal(a, sf.kept_offsets(600, 0.25, 8, 3, "a.weight"))  # and per run seed
    assert sf.kept_offsets(600, 0.3, 7, 3, "a.weight").size == 180  # 0.3 x 600 in floats is 180.00000000000003
    assert sf.kept_offsets(600, 1.0, 7, 3, "a.weight") is None and sf.kept_offsets(1, 0.01, 7, 3, "x") is None
    kept = sf.keep_layout(lay, 0.25, 7, 3)
    cut = sf.restrict(up, 0.25, 7, 3)
    assert layout_of(cut).digest == kept.digest != lay.digest and kept.n == 150 + 100
    b_off = sf.kept_offsets(400, 0.25, 7, 3, "b.weight")
    assert np.array_equal(cut.deltas["b.weight"].indices, 2 * b_off)  # a subset of the public positions
    assert np.array_equal(cut.deltas["b.weight"].values, up.deltas["b.weight"].values[b_off])
    assert sf.keep_layout(lay, 1.0, 7, 3) is lay and sf.restrict(up, 1.0, 7, 3) is up


@pytest.mark.parametrize("bad", [0.0, 0.005, 1.01, math.nan, math.inf, -1, True, "0.5", None])
def test_a_keep_fraction_outside_its_range_is_refused(bad):
    with pytest.raises(ValueError, match="keep fraction"):
        sf.check_keep(bad)


def test_the_settings_are_validated():
    assert PrivacySettings().secure_fit_factor == 1.2 and PrivacySettings().secure_keep == 1.0
    for bad in ({"secure_fit_factor": 0.9}, {"secure_fit_factor": math.inf}, {"secure_fit_factor": 11.0},
                {"secure_keep": 0.0}, {"secure_keep": 1.5}, {"secure_keep": math.nan}):
        with pytest.raises(ValueError, match="secure_"):
            PrivacySettings(**bad)


def test_the_budget_is_linkfits_rule_at_a_low_quantile_of_the_known_rates():
    assert (sf.SAFETY, sf.MARGIN_S) == (linkfit.SAFETY, linkfit.MARGIN_S)
    assert sf.secure_budget([], 30.0) == 0 and sf.secure_budget([0.0, math.nan, -5.0], 30.0) == 0
    assert sf.secure_budget([1000.0], 30.0) == linkfit.upload_budget(1000.0, 30.0)
    assert sf.secure_budget([5000.0, 1000.0, 9000.0], 30.0) == linkfit.upload_budget(1000.0, 30.0)  # the slowest
    rates = [1000.0 * (i + 1) for i in range(21)]  # 1..21 kB/s: the 0.1 quantile is the third slowest
    assert sf.secure_budget(rates, 11.0) == linkfit.upload_budget(3000.0, 11.0)
    assert sf.secure_budget([1000.0], 0.5) == 1  # no time left: the least budget


def test_the_keep_fraction_fits_the_budget_and_the_cap_over_the_plain_fit():
    values, bits, k = 100_000, 24, 10
    ladder = [4 * values + 20_000, 2 * values + 20_000, values + 20_000]  # fp32, fp16, int8 (positions coded)
    assert sf.fitted_keep(values, bits, k, 0, ladder, 1.2) == 1.0  # no rate known: every position
    assert sf.fitted_keep(values, bits, k, 0, ladder, 1.2, limit=0.5) == 0.5
    assert sf.fitted_keep(values, bits, k, 10**9, ladder, 1.2) == 1.0  # fp32 fits: 1.2 x fp32 holds the ring
    budget = (ladder[1] + ladder[2]) // 2  # int8 fits, fp16 does not
    keep = sf.fitted_keep(values, bits, k, budget, ladder, 1.2)
    sent = sf.masked_bytes(math.ceil(keep * values), bits) + k * sf.PER_NEIGHBOUR_BYTES + sf.ROUND_BYTES
    assert 0.3 < keep < 1 and sent <= 1.2 * ladder[2] < sent * 1.001 + 100
    assert sf.fitted_keep(values, bits, k, budget, ladder, 2.0) > keep  # a looser cap keeps more
    tight = 30_000  # below even int8: the plain fit keeps its largest values up to the budget, as must the ring
    keep = sf.fitted_keep(values, bits, k, tight, ladder, 1.2)
    assert sf.masked_bytes(math.ceil(keep * values), bits) <= tight
    assert sf.fitted_keep(values, bits, k, 100, ladder, 1.2) == sf.MIN_KEEP  # never below the floor
    assert sf.fitted_keep(values, bits, k, 100, ladder, 1.2, floor=0.1) == 0.1
    with pytest.raises(ValueError, match="fit factor"):
        sf.fitted_keep(values, bits, k, budget, ladder, 0.5)


def test_the_coordinator_fits_the_round_to_the_selected_devices_reported_uplinks():
    from coordinator.secure_fit import plain_ladder, round_keep, selected_rates

    up = _upload(np.random.default_rng(1), n=20_000)
    lay = layout_of(up)
    status = {"d0": {"uplink_kbps": 80.0}, "d1": {"uplink_kbps": 8000.0}, "d2": {"uplink_kbps": "fast"}, "d3": {}}
    registry = SimpleNamespace(get=lambda d: SimpleNamespace(info=status[d]) if d in status else None)
    assert selected_rates(registry, ("d0", "d1", "d2", "d3", "d4")) == [10_000.0, 1_000_000.0]
    ladder = plain_ladder(lay, "fp32", "int8", False, "fed")
    assert len(ladder) == 3 and ladder[0] > ladder[1] > ladder[2] > lay.n
    settings = PrivacySettings(secure_aggregation=True)
    fs: Any = SimpleNamespace(value_codec="fp32", fit_lowest_codec="int8", compress=False, fit_min_keep=0.1)

    def keep_of(selected: tuple[str, ...], seconds: float) -> tuple[float, int]:
        return round_keep(settings, fs, "fed", registry, selected, lay, 22, 1, seconds)

    keep, budget = keep_of(("d0", "d1"), 20.0)  # 10 kB/s for 10 s (20 s less a stage)
    assert budget == sf.secure_budget([10_000.0], 10.0)
    assert keep == sf.fitted_keep(lay.n, 22, 1, budget, ladder, 1.2, floor=0.1) and 0.1 < keep < 1
    assert keep_of(("d0",), 2.0)[0] == 0.1  # no time: a plain fit's least share, no less
    assert keep_of(("d3", "d4"), 20.0) == (1.0, 0)  # no rate known: today's round


def test_a_fitted_secure_round_sums_the_kept_positions_and_its_plan_round_trips():
    rng = np.random.default_rng(2)
    ups = {f"d{i}": _upload(rng) for i in range(5)}
    s = PrivacySettings(secure_aggregation=True, secure_value_bits=28, secure_keep=0.3)
    out = secure_sum(s, "t", 3, 7, ups, None)
    assert out.reason is None and out.update is not None
    kept = sf.keep_layout(layout_of(ups["d0"]), 0.3, 7, 3)
    assert layout_of(out.update).digest == kept.digest
    for name in ("a.weight", "b.weight"):
        plain = sum(sf.restrict(u, 0.3, 7, 3).deltas[name].values.astype(np.float64) for u in ups.values())
        assert np.abs(out.update.deltas[name].values - plain).max() < 1e-5
    full = secure_sum(PrivacySettings(secure_aggregation=True, secure_value_bits=28), "t", 3, 7, ups, None)
    ring_bits = plan_round(s, "t", 3, tuple(sorted(ups)), layout_of(ups["d0"]), 7, None, None).params.ring.bits
    saved = sf.masked_bytes(1000, ring_bits) - sf.masked_bytes(kept.n, ring_bits)  # the values not kept, no more
    assert all(full.bytes_per_device[d] - out.bytes_per_device[d] == saved for d in ups)
    planned = plan_round(s, "t", 3, tuple(sorted(ups)), layout_of(ups["d0"]), 7, None, None, keep=0.3)
    raw = plan_secure(planned)
    assert raw["keep"] == 0.3 and raw["length"] == kept.n and raw["layout"] == kept.digest
    back = secure_from_plan(raw, 3, tuple(sorted(ups)))
    assert back is not None and back.keep == 0.3 and layout_of(back.fitted(ups["d1"])).digest == raw["layout"]
    old = {k: v for k, v in plan_secure(plan_round(s, "t", 3, tuple(sorted(ups)), layout_of(ups["d0"]), 7, None,
                                                   None)).items() if k != "keep"}
    assert secure_from_plan(old, 3, tuple(sorted(ups))).keep == 1.0  # a plan of an earlier release: every position


def test_a_cohort_with_unmeasured_fitting_devices_is_fitted_to_the_lowest_codecs_plain_upload():
    """Devices that fit their uploads but measured no rate yet (``info.upload_fit``) send the lowest codec's size
    in a plain round (edge_client.linkfit): the secure round's bytes stay within the cap of that size, though the
    measured devices' rates alone would hold every common position."""
    from coordinator.secure_fit import plain_ladder, round_keep, unmeasured_fitting

    up = _upload(np.random.default_rng(3), n=20_000)
    lay = layout_of(up)
    status = {"fast": {"uplink_kbps": 80_000.0}, "new": {"upload_fit": True}, "plan": {},
              "odd": {"upload_fit": "yes"}, "both": {"upload_fit": True, "uplink_kbps": 80_000.0}}
    registry = SimpleNamespace(get=lambda d: SimpleNamespace(info=status[d]) if d in status else None)
    assert unmeasured_fitting(registry, ("fast", "new", "plan", "odd", "both", "gone")) == 1
    settings = PrivacySettings(secure_aggregation=True)
    fs: Any = SimpleNamespace(value_codec="fp32", fit_lowest_codec="int8", compress=False, fit_min_keep=0.1)
    bits, k = 27, 4
    lowest = plain_ladder(lay, "fp32", "int8", False, "fed")[-1]

    def sent(keep: float) -> int:  # a device's bytes in a secure round at this keep fraction
        return sf.masked_bytes(math.ceil(keep * lay.n), bits) + k * sf.PER_NEIGHBOUR_BYTES + sf.ROUND_BYTES

    keep_fast, budget = round_keep(settings, fs, "fed", registry, ("fast", "plan"), lay, bits, k, 60.0)
    assert budget > sent(1.0) and keep_fast == 1.0  # measured devices only: the whole vector fits their budget
    keep, budget = round_keep(settings, fs, "fed", registry, ("fast", "new", "plan"), lay, bits, k, 60.0)
    assert budget > 0 and 0.1 < keep < 1.0, keep
    assert sent(keep) <= 1.2 * lowest < sent(keep + 0.01)  # the largest within 1.2 x the int8 upload
    assert round_keep(settings, fs, "fed", registry, ("new",), lay, bits, k, 60.0) == (keep, 0)  # no rate at all
    assert round_keep(settings, fs, "fed", registry, ("plan", "odd"), lay, bits, k, 60.0) == (1.0, 0)  # plan: fp32
    slow = {"slow": {"uplink_kbps": 8.0}, "new": {"upload_fit": True}}
    reg2 = SimpleNamespace(get=lambda d: SimpleNamespace(info=slow[d]))
    keep_slow, b = round_keep(settings, fs, "fed", reg2, ("slow", "new"), lay, bits, k, 20.0)
    assert b < lowest and keep_slow == round_keep(settings, fs, "fed", reg2, ("slow",), lay, bits, k, 20.0)[0]
