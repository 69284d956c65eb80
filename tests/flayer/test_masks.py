"""Eq. 5-9 (layer-wise masks) and the released code's per-tensor / per-kernel rule."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from flayer.layers import layer_plan
from flayer.masks import (
    keep_count,
    layer_masks,
    mask_count,
    ref_keep_fraction,
    ref_masks,
    ref_prune_count,
    top_k_positions,
    upload_fraction,
)
from flayer.models import FedAvgCNN


def test_upload_fraction_eq5_9():
    assert [upload_fraction(i, 4) for i in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert upload_fraction(1, 20) == 0.1  # the floor
    assert upload_fraction(0, 3) == 0.1
    assert upload_fraction(9, 10, floor=0.1, cap=0.8) == 0.8
    with pytest.raises(ValueError):
        upload_fraction(1, 0)
    with pytest.raises(ValueError):
        upload_fraction(1, 3, floor=0.5, cap=0.4)


def test_keep_count_ignores_binary_noise():
    assert keep_count(0.3, 10) == 3  # 0.3 * 10 = 3.0000000000000004 in floats
    assert keep_count(0.1, 10) == 1
    assert keep_count(0.25, 10) == 3
    assert keep_count(1.0, 7) == 7


def test_top_k_positions_hand_example():
    s = torch.tensor([0.5, 0.1, 0.9, 0.5, 0.3])
    assert top_k_positions(s, 2).tolist() == [0, 2]  # 0.9 and the first 0.5 (ties: lower position)
    assert top_k_positions(s, 3).tolist() == [0, 2, 3]
    assert top_k_positions(s, 0).tolist() == []
    assert top_k_positions(s, 9).tolist() == [0, 1, 2, 3, 4]


@settings(max_examples=80, deadline=None)
@given(arrays(np.float32, st.integers(1, 200), elements=st.floats(-4, 4, width=32)), st.data())
def test_top_k_keeps_exactly_k_largest(values, data):
    k = data.draw(st.integers(0, values.size))
    score = torch.from_numpy(values.copy())
    pos = top_k_positions(score, k)
    assert pos.dtype == torch.int64 and pos.numel() == k
    assert torch.all(pos[1:] > pos[:-1])  # sorted, unique
    kept = torch.zeros(values.size, dtype=torch.bool)
    kept[pos] = True
    if 0 < k < values.size:
        assert score[kept].min() >= score[~kept].max()


class TwoLayer(torch.nn.Module):
    def __init__(self, a: int, b: int, c: int) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(a, b)
        self.l2 = torch.nn.Linear(b, c)
        self.l3 = torch.nn.Linear(c, 2)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1),
       st.sampled_from([(0.1, 1.0), (0.3, 0.9), (0.05, 0.5)]))
def test_layer_masks_keep_ceil_up_n_largest_per_layer(a, b, c, seed, floor_cap):
    floor, cap = floor_cap
    model = TwoLayer(a, b, c)
    plan = layer_plan(model)
    gen = torch.Generator().manual_seed(seed)
    # a coarse grid of values makes ties likely
    change = {n: (torch.randint(-3, 4, p.shape, generator=gen).float()) for n, p in model.named_parameters()}
    masks = layer_masks(change, plan, floor, cap)
    assert set(masks) == set(change)
    for layer in plan.layers:
        n = sum(change[p].numel() for p in layer.params)
        up = min(max(Fraction(layer.index, plan.num_layers), Fraction(str(floor))), Fraction(str(cap)))
        k = min(n, math.ceil(up * n))
        kept, dropped = [], []
        for p in layer.params:
            m = masks[p]
            flat = change[p].abs().reshape(-1)
            sel = torch.full_like(flat, m is None, dtype=torch.bool)
            if m is not None:
                assert m.dtype == torch.int64 and torch.all(m[1:] > m[:-1])
                sel[m] = True
            kept.append(flat[sel])
            dropped.append(flat[~sel])
        kept_all, dropped_all = torch.cat(kept), torch.cat(dropped)
        assert kept_all.numel() == k
        if kept_all.numel() and dropped_all.numel():
            assert kept_all.min() >= dropped_all.max()


def test_layer_masks_cnn_fractions():
    model = FedAvgCNN(1, 10, 1024)
    change = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    masks = layer_masks(change, layer_plan(model))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert masks["fc.weight"] is None and masks["fc.bias"] is None  # head layer i = L uploads UP = 1
    for names, up in ((("conv1.0.weight", "conv1.0.bias"), 0.25), (("conv2.0.weight", "conv2.0.bias"), 0.5),
                      (("fc1.0.weight", "fc1.0.bias"), 0.75)):
        sent, total = mask_count({n: masks[n] for n in names}, shapes)
        assert sent == math.ceil(up * total)


def test_ref_keep_and_prune_rules():
    assert [ref_keep_fraction(t, 8) for t in (0, 4, 7)] == [0.1, 0.5, 0.875]
    assert ref_keep_fraction(19, 20) == 0.9
    # 5x5 kernel, keep 0.9 -> drop round(25 * 0.1) = round(2.4999...) = 2
    assert ref_prune_count(25, 1 - 0.9) == 2
    assert ref_prune_count(25, 0.5) == 12  # round half to even
    assert ref_prune_count(25, 0.01) == 1  # at least one
    assert ref_prune_count(25, 0.99) == 24  # at most all but one
    assert ref_prune_count(1, 0.5) == 1  # a 1x1 kernel drops its only entry


def test_ref_masks_per_kernel_hand_example():
    # P = 4 tensors: conv weight (t=0, keep 0.1), a 1-D bias (t=1, keep 0.25), then the last two whole.
    conv = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).reshape(2, 1, 3, 3)
    conv[1, 0] = torch.tensor([[9.0, 0, 0], [0, 8.0, 0], [0, 0, 7.0]])
    bias = torch.tensor([0.1, -0.9, 0.3, 0.2, -0.5, 0.0, 0.05, 0.4])
    change = {"c": conv, "b": bias, "w": torch.ones(3, 2), "o": torch.ones(3)}
    m = ref_masks(change, ["c", "b", "w", "o"])
    # mask ratio 0.9 of a 9-entry kernel: drop round(8.1) = 8, keep 1 per kernel: the largest |change|
    assert m["c"].tolist() == [8, 9 + 0]  # kernel 0: entry 8 (value 8); kernel 1: entry 0 (value 9)
    # bias: keep 0.25 -> drop round(8 * 0.75) = 6, keep the 2 largest |change|: -0.9 and -0.5
    assert m["b"].tolist() == [1, 4]
    assert m["w"] is None and m["o"] is None


def test_ref_masks_leave_2d_weights_and_tail_whole():
    model = FedAvgCNN(1, 10, 1024)
    names = [n for n, _ in model.named_parameters()]
    change = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    m = ref_masks(change, names)
    assert m["fc1.0.weight"] is None  # 2-D
    assert m["fc.weight"] is None and m["fc.bias"] is None  # last two tensors
    # conv2.0.weight is tensor 2 of 8: keep 0.25 of every 5x5 kernel -> drop round(25 * 0.75) = 19, keep 6
    assert m["conv2.0.weight"].numel() == 64 * 32 * 6
    w = change["conv2.0.weight"].abs().reshape(64 * 32, 25)
    sel = torch.zeros(64 * 32 * 25, dtype=torch.bool)
    sel[m["conv2.0.weight"]] = True
    sel = sel.reshape(64 * 32, 25)
    for row in range(0, 64 * 32, 97):
        assert w[row][sel[row]].min() >= w[row][~sel[row]].max()
