"""The layer plan of the three models and the rule for any nn.Module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flayer.layers import layer_plan
from flayer.models import FastText, FedAvgCNN, ResNet18


def test_fedavgcnn_plan():
    plan = layer_plan(FedAvgCNN(1, 10, 1024))
    assert [x.name for x in plan.layers] == ["conv1", "conv2", "fc1", "fc"]
    assert [x.index for x in plan.layers] == [1, 2, 3, 4]
    assert plan.layers[0].params == ("conv1.0.weight", "conv1.0.bias")
    assert [x.name for x in plan.head] == ["fc"] and plan.tensors(head=True) == ("fc.weight", "fc.bias")


def test_resnet18_plan_and_buffers():
    model = ResNet18(3, 10)
    plan = layer_plan(model, head_layers=2)
    assert [x.name for x in plan.layers] == ["conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert [x.name for x in plan.head] == ["layer4", "fc"]
    assert plan.layers[1].buffers == ("bn1.running_mean", "bn1.running_var")  # float buffers only
    # every parameter and float buffer belongs to exactly one layer; integer buffers to none
    floats = [n for n, v in model.state_dict().items() if v.is_floating_point()]
    assert sorted(plan.tensors()) == sorted(floats)
    assert not any(t.endswith("num_batches_tracked") for t in plan.tensors())


def test_fasttext_plan():
    plan = layer_plan(FastText(50, 4, 8))
    assert [x.name for x in plan.layers] == ["embedding", "fc1", "fc"]
    assert plan.num_layers == 3 and plan.layer_of("fc1.bias").index == 2


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))  # on the root: a layer of its own, first
        self.act = nn.ReLU()  # no parameters: not a layer
        self.enc = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.out = nn.Linear(4, 2)


def test_generic_module_rule_and_override():
    m = Custom()
    plan = layer_plan(m)
    assert [x.name for x in plan.layers] == ["", "enc", "out"]
    assert plan.layers[0].params == ("scale",)
    assert plan.layers[1].buffers == ("enc.1.running_mean", "enc.1.running_var")
    over = layer_plan(m, head_layers=2, paths=["", "enc.0", "enc.1", "out"])
    assert [x.name for x in over.layers] == ["", "enc.0", "enc.1", "out"]
    assert [x.name for x in over.head] == ["enc.1", "out"]


def test_plan_errors_name_the_problem():
    m = Custom()
    with pytest.raises(ValueError, match="not a module"):
        layer_plan(m, paths=["enc", "nope"])
    with pytest.raises(ValueError, match="falls under none"):
        layer_plan(m, paths=["enc", "out"])
    with pytest.raises(ValueError, match="head_layers"):
        layer_plan(m, head_layers=4)
