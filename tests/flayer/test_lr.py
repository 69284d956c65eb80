"""Eq. 4 (per-layer learning rates) against hand-computed values, and the optimizer groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flayer.layers import layer_plan
from flayer.lr import (
    LrRule,
    eq4_multiplier,
    flayer_layer_lrs,
    layer_lr,
    layer_optimizer,
    lr_hook,
    ref_module_lrs,
    tensor_grad_norms,
)
from flayer.models import FedAvgCNN


def test_eq4_hand_computed():
    # eta=0.1, ||g||=0.5, layer 2 of 4: 0.1 * (1 + ln(1 + 2) * 2/4)
    assert layer_lr(0.1, 0.5, 2, 4, 1e-8, None) == pytest.approx(0.1 * (1 + math.log(3.0) * 0.5), rel=1e-12)
    # ||g||=1, layer 4 of 4: 1 + ln 2
    assert eq4_multiplier(1.0, 4, 4, 1e-8, 10.0) == pytest.approx(1 + math.log(2.0), rel=1e-12)
    # layer 0 (the released code's first module) and huge gradients give multiplier ~1
    assert eq4_multiplier(0.3, 0, 3, 1e-8, None) == 1.0
    assert eq4_multiplier(1e12, 3, 3, 1e-8, None) == pytest.approx(1.0, abs=1e-11)


def test_eq4_zero_gradient_uses_floor_and_cap():
    # ||g|| = 0: the floor eps replaces it; the cap then bounds the multiplier.
    uncapped = eq4_multiplier(0.0, 2, 4, 1e-4, None)
    assert uncapped == pytest.approx(1 + math.log(1 + 1e4) * 0.5, rel=1e-12)
    assert eq4_multiplier(0.0, 2, 4, 1e-4, 3.0) == 3.0
    assert eq4_multiplier(0.0, 2, 4, 1e-4, 100.0) == pytest.approx(uncapped)
    # a norm below eps is treated as eps
    assert eq4_multiplier(1e-9, 1, 1, 1e-6, None) == eq4_multiplier(1e-6, 1, 1, 1e-6, None)
    assert math.isfinite(layer_lr(0.005, 0.0, 4, 4, 1e-8, None))


@pytest.mark.parametrize("bad", [dict(grad_norm=-1.0), dict(eps=0.0), dict(num_layers=0), dict(cap=0.5)])
def test_eq4_rejects_bad_input(bad):
    args = dict(grad_norm=1.0, i=1, num_layers=2, eps=1e-8, cap=10.0) | bad
    with pytest.raises(ValueError):
        eq4_multiplier(**args)


def test_eq4_passes_nan_on_instead_of_raising():
    """A model gone non-finite gives NaN gradient norms: the rate is NaN too, and the device that
    trains with it detects the non-finite loss and update and skips the round (edge_client.work)."""
    assert math.isnan(eq4_multiplier(float("nan"), 1, 2, 1e-8, 10.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0, 100), min_size=1, max_size=3), min_size=1, max_size=6),
       st.floats(1.0, 50.0))
def test_layer_lrs_are_eq4_of_the_layer_norm(norms, cap):
    lrs = flayer_layer_lrs(0.01, norms, 1e-8, cap)
    num = len(norms)
    for i, (lr, layer) in enumerate(zip(lrs, norms), start=1):
        g = math.sqrt(sum(x * x for x in layer))
        expected = 0.01 * min(1 + math.log(1 + 1 / max(g, 1e-8)) * i / num, cap)
        assert lr == pytest.approx(expected, rel=1e-12)
        assert 0.01 <= lr <= 0.01 * cap * (1 + 1e-12)


def test_ref_module_lrs_hand_computed():
    # three modules (L = 2): module 0 -> eta, module 2 (head) -> eta/5,
    # module 1 -> mean over its tensors of scale*eta*(1 + ln(1 + 1/g) * 1/2)
    eta, scale = 0.01, 20.0
    lrs = ref_module_lrs(eta, [[0.3], [1.0, 0.5], [2.0]], 2, scale, 1e-8, None)
    m1 = (scale * eta * (1 + math.log(2.0) / 2) + scale * eta * (1 + math.log(3.0) / 2)) / 2
    assert lrs == pytest.approx([eta, m1, eta / 5], rel=1e-12)


def _cnn_with_grads(seed: int = 0) -> FedAvgCNN:
    torch.manual_seed(seed)
    model = FedAvgCNN(1, 10, 1024)
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    F.cross_entropy(model(x), y).backward()
    return model


def test_optimizer_groups_follow_eq4():
    model = _cnn_with_grads()
    plan = layer_plan(model)
    opt = layer_optimizer(model, plan, 0.005)
    assert [g["names"] for g in opt.param_groups] == [list(layer.params) for layer in plan.layers]
    rule = LrRule(0.005, eps=1e-8, cap=4.0, every="step")
    lr_hook(opt, rule)(0, 3)
    named = dict(model.named_parameters())
    for layer, group in zip(plan.layers, opt.param_groups):
        g = torch.cat([named[p].grad.reshape(-1) for p in layer.params]).norm().item()
        expected = 0.005 * min(1 + math.log(1 + 1 / g) * layer.index / plan.num_layers, 4.0)
        assert group["lr"] == pytest.approx(expected, rel=1e-5)


def test_zero_gradient_layer_gets_capped_rate():
    model = _cnn_with_grads()
    plan = layer_plan(model)
    for p in model.fc1.parameters():
        p.grad.zero_()
    opt = layer_optimizer(model, plan, 0.01)
    lr_hook(opt, LrRule(0.01, eps=1e-8, cap=7.5))(0, 0)
    assert opt.param_groups[2]["lr"] == pytest.approx(0.01 * 7.5)
    uncapped = layer_optimizer(model, plan, 0.01)
    lr_hook(uncapped, LrRule(0.01, eps=1e-8, cap=None))(0, 0)
    assert uncapped.param_groups[2]["lr"] == pytest.approx(0.01 * (1 + math.log1p(1e8) * 3 / 4))


def test_epoch_mode_only_reads_the_first_batch():
    model = _cnn_with_grads()
    plan = layer_plan(model)
    opt = layer_optimizer(model, plan, 0.01)
    hook = lr_hook(opt, LrRule(0.01, every="epoch"))
    hook(0, 5)
    assert all(g["lr"] == 0.01 for g in opt.param_groups)
    hook(1, 0)
    assert any(g["lr"] != 0.01 for g in opt.param_groups)


def test_tensor_grad_norms_grouped_and_missing_grad_is_zero():
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3.0, 4.0, 0.0])
    assert tensor_grad_norms([[a], [b]]) == [[5.0], [0.0]]
