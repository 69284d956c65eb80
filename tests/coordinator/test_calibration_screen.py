"""Calibration reports are a device's claims: screened on arrival (layers, finite, bounded values, a whole
bounded sample count), weighed so that one claim cannot outweigh every other report, and resolved to a
fallback rather than stopping the coordinator when nothing usable came."""

from __future__ import annotations

import pytest

from coordinator.calibration import MAX_SAMPLE_WEIGHT, Calibration
from flayer.config import TrainConfig
from flayer.engine.calibration import fallback_calibration, robust_weights, screen_report
from flayer.models import ModelSpec
from flayer.sensitivity import MAX_SENSITIVITY, fallback_report, report_curve, split_layer
from flayer.strategies import make_strategy
from flayer.strategies.base import Strategy

SPEC = ModelSpec(name="cnn", in_channels=1, height=16, width=16, num_classes=10)  # 4 layers
HONEST = {"layer.1": 1.0, "layer.2": 1.0, "layer.3": 1.0, "layer.4": 1.5}  # alone: split 3 (jump at layer 4)
LIAR = {"layer.1": 0.5, "layer.2": 0.62, "layer.3": 0.7, "layer.4": 1.0}  # alone: split 1 (ratio 1.24 at layer 2)


def _playerfl() -> Strategy:
    return make_strategy("playerfl", SPEC, TrainConfig(lr=0.05))


def _cal(strategy: Strategy | None, n: int = 3) -> Calibration:
    return Calibration(frozenset(f"dev-{i}" for i in range(n)), 100.0, strategy)


def test_the_two_test_curves_split_where_the_tests_below_assume() -> None:
    assert split_layer(list(HONEST.values())) == 3 and split_layer(list(LIAR.values())) == 1


@pytest.mark.parametrize("report, needle", [
    ({k: v for k, v in HONEST.items() if k != "layer.4"}, "missing ['layer.4']"),
    ({**HONEST, "layer.5": 2.0}, "unexpected ['layer.5']"),
    ({**HONEST, "layer.4": 3e38}, "exceeds"),
    ({k: 3e38 for k in HONEST}, "exceeds"),
    ({**HONEST, "layer.2": -1.0}, "non-negative"),
    ({**HONEST, "layer.3": 0.5}, "cannot decrease"),
    ({k: 0.0 for k in HONEST}, "all zero"),
])
def test_add_refuses_a_report_the_strategy_cannot_use(report: dict[str, float], needle: str) -> None:
    cal = _cal(_playerfl())
    status, reason = cal.add("dev-0", {**report, "sample_weight": 50.0})
    assert status == "rejected" and needle in reason, reason
    assert cal.reports == {}  # nothing taken: the device may send a corrected report
    assert cal.add("dev-0", {**HONEST, "sample_weight": 50.0}) == ("accepted", "")


@pytest.mark.parametrize("weight", [0.0, -3.0, 2.5, float(2**32 - 1), float(MAX_SAMPLE_WEIGHT + 1)])
def test_add_refuses_a_sample_weight_that_is_not_a_bounded_count(weight: float) -> None:
    for strategy in (_playerfl(), None):
        status, reason = _cal(strategy).add("dev-0", {**HONEST, "sample_weight": weight})
        assert status == "rejected" and "sample_weight" in reason and f"{MAX_SAMPLE_WEIGHT:,}" in reason, reason


def test_add_takes_the_largest_count_allowed() -> None:
    cal = _cal(_playerfl())
    assert cal.add("dev-0", {**HONEST, "sample_weight": float(MAX_SAMPLE_WEIGHT)}) == ("accepted", "")
    assert cal.weights == {"dev-0": float(MAX_SAMPLE_WEIGHT)}


def test_sensitivity_values_are_bounded() -> None:
    assert report_curve({**HONEST, "layer.4": MAX_SENSITIVITY}, 4)[-1] == MAX_SENSITIVITY
    with pytest.raises(ValueError, match="exceeds"):
        report_curve({**HONEST, "layer.4": 3e38}, 4)


def test_resolve_drops_reports_taken_unscreened_and_resolves_the_rest() -> None:
    """A calibration built without its strategy takes a report missing a layer; resolve drops it."""
    cal = _cal(None)
    assert cal.add("dev-0", {**HONEST, "sample_weight": 40.0})[0] == "accepted"
    assert cal.add("dev-1", {"layer.1": 1.0, "layer.2": 2.0, "layer.3": 3.0, "sample_weight": 40.0})[0] == "accepted"
    assert cal.add("dev-2", {**{k: 3e38 for k in HONEST}, "sample_weight": 40.0})[0] == "accepted"
    configured, resolved = cal.resolve(_playerfl())
    assert resolved == {"split": 3} and not configured.needs_calibration()


@pytest.mark.parametrize("name, options, expected", [
    ("playerfl", {}, {"split": 3}),
    ("flayer", {"head_layers": "auto"}, {"head_layers": 1}),
])
def test_resolve_falls_back_when_no_report_is_usable(name: str, options: dict[str, object],
                                                     expected: dict[str, int]) -> None:
    strategy = make_strategy(name, SPEC, TrainConfig(lr=0.05), options)
    empty = _cal(strategy)
    configured, resolved = empty.resolve(strategy)  # the deadline passed without a single report
    assert resolved == expected and not configured.needs_calibration()
    bad = _cal(None)
    bad.add("dev-0", {"layer.1": 1.0, "sample_weight": 10.0})
    assert bad.resolve(strategy)[1] == expected


def test_a_huge_claimed_weight_does_not_choose_the_split_alone() -> None:
    cal = _cal(_playerfl())
    assert cal.add("dev-0", {**HONEST, "sample_weight": 100.0})[0] == "accepted"
    assert cal.add("dev-1", {**HONEST, "sample_weight": 120.0})[0] == "accepted"
    assert cal.add("dev-2", {**LIAR, "sample_weight": float(MAX_SAMPLE_WEIGHT)})[0] == "accepted"
    # the liar's claim alone would decide: weighted by the claims, the mean curve is the liar's
    assert _playerfl().resolve_calibration([HONEST, HONEST, LIAR], [100.0, 120.0, float(MAX_SAMPLE_WEIGHT)]) \
        == {"split": 1}
    assert cal.resolve(_playerfl())[1] == {"split": 3}


def test_robust_weights_cap_at_the_runner_up() -> None:
    assert robust_weights([5.0]) == [5.0]
    assert robust_weights([10.0, 3.0]) == [3.0, 3.0]
    assert robust_weights([100.0, 120.0, 1e7]) == [100.0, 120.0, 120.0]
    assert robust_weights([7.0, 7.0, 2.0]) == [7.0, 7.0, 2.0]


def test_screen_report_and_the_fallback_report() -> None:
    s = _playerfl()
    assert screen_report(s, HONEST) == ""
    assert "missing" in screen_report(s, {"layer.1": 1.0})
    assert split_layer(list(fallback_report(4).values()), 3.0) == 3 and fallback_report(1) == {"layer.1": 1.0}
    assert fallback_calibration(s, "test")[1] == {"split": 3}
