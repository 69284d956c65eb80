"""PLayer-FL's federation sensitivity against a hand computation, and the split rule on constructed curves."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from flayer.layers import layer_plan
from flayer.sensitivity import (
    aggregate_curves,
    auto_head_layers,
    federation_sensitivity,
    layer_importance,
    normalise_curve,
    report_curve,
    split_layer,
)


class Tiny(nn.Module):
    """y = b(a(x)): a = Linear(2, 2) with bias, b = Linear(2, 1) with bias, no nonlinearity."""

    layer_names = ("a", "b")

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 1)
        with torch.no_grad():
            self.a.weight.copy_(torch.tensor([[1.0, 2.0], [-1.0, 0.5]]))
            self.a.bias.copy_(torch.tensor([0.3, -0.2]))
            self.b.weight.copy_(torch.tensor([[2.0, -3.0]]))
            self.b.bias.copy_(torch.tensor([7.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_metric_equals_hand_computation():
    model = Tiny()
    plan = layer_plan(model)
    x = torch.tensor([[1.0, 3.0]])
    model(x).sum().backward()  # L = y, one sample
    # by hand: h = A x + a_b = [1+6+0.3, -1+1.5-0.2] = [7.3, 0.3]
    # dL/dB = h = [7.3, 0.3];   dL/dA = B^T x^T = [[2*1, 2*3], [-3*1, -3*3]] = [[2, 6], [-3, -9]]
    # I_a = ((1*2)^2 + (2*6)^2 + (-1*-3)^2 + (0.5*-9)^2) / 4 = (4 + 144 + 9 + 20.25) / 4 = 44.3125
    # I_b = ((2*7.3)^2 + (-3*0.3)^2) / 2 = (213.16 + 0.81) / 2 = 106.985     (biases skipped)
    imp = layer_importance(model, plan)
    assert imp == pytest.approx([44.3125, 106.985], rel=1e-6)
    assert federation_sensitivity(imp) == pytest.approx([44.3125, 151.2975], rel=1e-6)


def test_biases_do_not_count():
    model = Tiny()
    plan = layer_plan(model)
    x = torch.tensor([[1.0, 3.0]])
    model(x).sum().backward()
    before = layer_importance(model, plan)
    with torch.no_grad():
        model.a.bias.mul_(100.0)
        model.b.bias.mul_(100.0)
    model.a.bias.grad.mul_(100.0)
    model.b.bias.grad.mul_(100.0)
    assert layer_importance(model, plan) == before


@pytest.mark.parametrize("curve,threshold,split", [
    ([1.0, 1.05, 1.08, 3.0], 1.1, 3),  # flat body, jump at the last layer: the last layer stays local
    ([1.0, 1.5, 1.6, 1.7], 1.1, 1),  # jump already at layer 2
    ([0.2, 0.21, 0.22, 0.8, 0.9, 1.0], 2.0, 3),  # the first jump wins over later ones
    ([1.0, 1.02, 1.05, 1.06], 1.1, 2),  # no ratio above t: before the largest ratio (layer 3)
    ([5.0], 1.1, 0),  # one layer: nothing to split
    ([0.0, 0.5, 1.0], 1.1, 1),  # zero below: infinite ratio at layer 2
])
def test_split_rule_on_constructed_curves(curve, threshold, split):
    assert split_layer(curve, threshold) == split
    assert auto_head_layers(curve, threshold) == len(curve) - split
    # scale-free: the same curve in other units gives the same split
    assert split_layer([7.5 * v for v in curve], threshold) == split


@pytest.mark.parametrize("curve,match", [
    ([], "empty"), ([1.0, 0.5], "cannot decrease"), ([0.0, 0.0], "all zero"), ([1.0, math.nan], "finite"),
])
def test_bad_curves_are_rejected(curve, match):
    with pytest.raises(ValueError, match=match):
        normalise_curve(curve)


def test_threshold_must_exceed_one():
    with pytest.raises(ValueError, match="threshold"):
        split_layer([1.0, 2.0], 1.0)


def test_reports_validated_and_weighted():
    a = {"layer.1": 1.0, "layer.2": 2.0}  # normalised [0.5, 1]
    b = {"layer.1": 3.0, "layer.2": 4.0}  # normalised [0.75, 1]
    curve = aggregate_curves([a, b], [1.0, 3.0], 2)
    assert curve == pytest.approx([(0.5 * 1 + 0.75 * 3) / 4, 1.0])
    # the reports survive a JSON round trip (what travels over the wire) unchanged
    assert aggregate_curves([json.loads(json.dumps(r)) for r in (a, b)], [1.0, 3.0], 2) == curve
    with pytest.raises(ValueError, match="missing"):
        report_curve({"layer.1": 1.0}, 2)
    with pytest.raises(ValueError, match="unexpected"):
        report_curve({"layer.1": 1.0, "layer.2": 2.0, "layer.3": 3.0}, 2)
    with pytest.raises(ValueError, match="finite non-negative"):
        report_curve({"layer.1": 1.0, "layer.2": float("inf")}, 2)
    with pytest.raises(ValueError, match="weights"):
        aggregate_curves([a], [0.0], 2)
