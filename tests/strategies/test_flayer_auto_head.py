"""FLAYER's head = auto: PLayer-FL's sensitivity curve picks s in a calibration round."""

import pytest

from flayer.config import TrainConfig
from flayer.partition import make_partition
from flayer.sensitivity import DEFAULT_THRESHOLD, aggregate_curves, auto_head_layers
from flayer.simulation import simulate
from flayer.engine import calibrate, initial_global_state
from flayer.strategies import make_strategy
from flayer.strategies.base import RoundContext
from flayer.train import client_data


@pytest.fixture(scope="module")
def shards(digits):
    part = make_partition(digits.y, digits.num_classes, 3, "dir0.5", 0)
    return [client_data(digits, c) for c in part.clients]


def test_auto_head_resolves_from_the_curve_and_runs(digits, shards):
    spec = digits.model_spec()
    s = make_strategy("flayer", spec, TrainConfig(lr=0.05), {"head_layers": "auto"})
    assert s.needs_calibration()
    g = initial_global_state(s, 0)
    reports = [s.calibrate(g, d, RoundContext(0, i, 0)) for i, d in enumerate(shards)]
    weights = [float(d.num_train) for d in shards]
    expected = max(1, auto_head_layers(aggregate_curves(reports, weights, 4), DEFAULT_THRESHOLD))
    configured, resolved = calibrate(s, shards, g, 0)
    assert resolved == {"head_layers": expected}
    assert not configured.needs_calibration() and configured.options.head_layers == expected
    assert len(configured.plan.head) == expected
    result = simulate(s, shards, rounds=1, seed=0)
    assert result.calibration == resolved and 0.0 <= result.final_acc <= 1.0


def test_flayer_ref_auto_head_counts_parameter_tensors(digits, shards):
    s = make_strategy("flayer-ref", digits.model_spec(), TrainConfig(lr=0.05), {"head_layers": "auto"})
    g = initial_global_state(s, 0)
    layers = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.05), {"head_layers": "auto"})
    _, by_layers = calibrate(layers, shards, g, 0)
    _, by_tensors = calibrate(s, shards, g, 0)
    # FedAvgCNN layers hold 2 parameter tensors each (weight, bias)
    assert by_tensors["head_layers"] == 2 * by_layers["head_layers"]


def test_auto_head_option_validation(digits):
    with pytest.raises(ValueError, match="head_layers"):
        make_strategy("flayer", digits.model_spec(), TrainConfig(), {"head_layers": "some"})
    with pytest.raises(ValueError, match="auto_threshold"):
        make_strategy("flayer", digits.model_spec(), TrainConfig(), {"head_layers": "auto", "auto_threshold": 0.5})
