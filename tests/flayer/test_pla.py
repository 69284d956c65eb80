"""Eq. 2 (PLA head initialisation)."""

from __future__ import annotations

import pytest
import torch

from flayer.pla import pla_mix, pla_state


def _states():
    g = {"body.w": torch.tensor([1.0, 2.0]), "fc.w": torch.tensor([[0.0, 4.0]]), "fc.b": torch.tensor([1.0])}
    local = {"fc.w": torch.tensor([[2.0, 0.0]]), "fc.b": torch.tensor([-1.0])}
    return g, local


def test_pla_hand_computed():
    g, local = _states()
    out = pla_state(g, local, ("fc.w", "fc.b"), 0.25)
    assert torch.equal(out["body.w"], g["body.w"])  # body <- global
    assert torch.allclose(out["fc.w"], torch.tensor([[0.5, 3.0]]))  # 0.25*local + 0.75*global
    assert torch.allclose(out["fc.b"], torch.tensor([0.5]))


def test_pla_extremes_are_exact():
    g, local = _states()
    g["fc.w"] = torch.tensor([[0.1, 0.7]])
    local["fc.w"] = torch.tensor([[0.3, 0.9]])
    zero = pla_mix(local, {k: g[k] for k in local}, 0.0)
    one = pla_mix(local, {k: g[k] for k in local}, 1.0)
    for k in local:
        assert torch.equal(zero[k], g[k])
        assert torch.equal(one[k], local[k])
    assert zero["fc.w"].data_ptr() != g["fc.w"].data_ptr()  # copies, not aliases


def test_pla_without_local_head_is_global():
    g, _ = _states()
    out = pla_state(g, {}, ("fc.w", "fc.b"), 0.8)
    assert all(torch.equal(out[k], g[k]) for k in g)


@pytest.mark.parametrize("acc", [-0.1, 1.5, float("nan")])
def test_pla_rejects_bad_weight(acc):
    g, local = _states()
    with pytest.raises(ValueError, match="A_l"):
        pla_state(g, local, ("fc.w",), acc)


def test_pla_rejects_shape_mismatch_and_unknown_head():
    g, local = _states()
    local["fc.w"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        pla_state(g, local, ("fc.w",), 1.0)
    with pytest.raises(KeyError):
        pla_state(g, {}, ("nope",), 0.5)
