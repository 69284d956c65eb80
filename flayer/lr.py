"""Per-layer learning rates, FLAYER Eq. 3-4, as SGD parameter groups built in one place.

Eq. 4: ``eta_i = eta * (1 + ln(1 + 1/||g_i||_2) * i / L)`` for layer i = 1..L, where g_i is the
layer's gradient. Deeper layers and layers with small gradients get larger steps. Two additions,
both config values:

- a floor ``eps`` on ||g_i||: a zero gradient (a frozen or dead layer) would divide by zero;
- a cap on the multiplier (the bracket): as ||g_i|| -> 0 the multiplier grows like ln(1/||g_i||),
  and a step size chosen for a vanishing gradient is applied to the following, larger ones.
  With a cap, ``eps`` only has to keep the arithmetic finite.

The released reference code (``flayer-ref``) computes the same bracket per parameter tensor on the
first mini-batch of each epoch, averages it per top-level module, multiplies by a model factor
(20 for the CNN), fixes the first module at eta and the head module at eta/5, and uses the
0-based module index with a hard-coded L (:func:`ref_module_lrs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .layers import LayerPlan
from .train import param_groups_by_lr

__all__ = [
    "LrRule",
    "eq4_multiplier",
    "flayer_layer_lrs",
    "layer_lr",
    "layer_optimizer",
    "lr_hook",
    "ref_module_lrs",
    "tensor_grad_norms",
]


def eq4_multiplier(grad_norm: float, i: int, num_layers: int, eps: float, cap: float | None) -> float:
    """The bracket of Eq. 4: ``min(1 + ln(1 + 1/max(||g||, eps)) * i / L, cap)``.

    ``cap=None`` leaves it uncapped. A NaN norm (a model that is no longer finite) gives NaN: the
    training that follows is not finite either, which the caller detects and reports (a device skips
    the round). Raises ValueError for a negative norm, ``eps <= 0``, ``L < 1`` or ``cap < 1``.
    """
    if math.isnan(grad_norm):
        return math.nan
    if not grad_norm >= 0.0:
        raise ValueError(f"gradient norm must be >= 0, got {grad_norm}")
    if not eps > 0.0 or num_layers < 1:
        raise ValueError(f"need eps > 0 and L >= 1, got eps={eps}, L={num_layers}")
    if cap is not None and not cap >= 1.0:
        raise ValueError(f"the multiplier cap must be >= 1, got {cap}")
    m = 1.0 + math.log1p(1.0 / max(grad_norm, eps)) * i / num_layers
    return m if cap is None else min(m, cap)


def layer_lr(eta: float, grad_norm: float, i: int, num_layers: int, eps: float, cap: float | None) -> float:
    """Eq. 4: the learning rate of layer ``i`` (1..L) whose gradient has L2 norm ``grad_norm``."""
    return eta * eq4_multiplier(grad_norm, i, num_layers, eps, cap)


def flayer_layer_lrs(eta: float, tensor_norms: Sequence[Sequence[float]], eps: float,
                     cap: float | None) -> list[float]:
    """Eq. 4 for every layer: ``tensor_norms[i-1]`` holds the gradient norms of layer i's tensors,
    whose combined norm sqrt(sum of squares) is ||g_i||. Layers are numbered 1..L in order."""
    num_layers = len(tensor_norms)
    return [layer_lr(eta, math.sqrt(sum(n * n for n in norms)), i, num_layers, eps, cap)
            for i, norms in enumerate(tensor_norms, start=1)]


def ref_module_lrs(eta: float, tensor_norms: Sequence[Sequence[float]], num_layers: int, scale: float,
                   eps: float, cap: float | None, head_divisor: float = 5.0) -> list[float]:
    """The released code's reading of Eq. 4 (``flayer-ref``).

    Module m (0-based) gets the mean over its parameter tensors t of
    ``scale * eta * (1 + ln(1 + 1/max(||g_t||, eps)) * m / L)``; then the first module is set to
    ``eta`` and the last (the head) to ``eta / head_divisor``. ``num_layers`` is the released
    code's hard-coded L (CNN 3, ResNet-18 6, fastText 2: the number of modules minus one).
    """
    out = []
    for m, norms in enumerate(tensor_norms):
        per_tensor = [scale * eta * eq4_multiplier(n, m, num_layers, eps, cap) for n in norms]
        out.append(sum(per_tensor) / len(per_tensor) if per_tensor else eta)
    if out:
        out[0] = eta
    if len(out) > 1:
        out[-1] = eta / head_divisor
    return out


@dataclass(frozen=True)
class LrRule:
    """Which reading of Eq. 4 to apply, and how often."""

    eta: float
    eps: float = 1e-8
    cap: float | None = 10.0
    every: Literal["step", "epoch"] = "step"  # every step, or from the first mini-batch of each epoch
    kind: Literal["flayer", "ref"] = "flayer"
    ref_num_layers: int = 0  # ``ref`` only: the hard-coded L
    ref_scale: float = 1.0  # ``ref`` only: the model factor (20 for the CNN)

    def lrs(self, tensor_norms: Sequence[Sequence[float]]) -> list[float]:
        if self.kind == "flayer":
            return flayer_layer_lrs(self.eta, tensor_norms, self.eps, self.cap)
        return ref_module_lrs(self.eta, tensor_norms, self.ref_num_layers, self.ref_scale, self.eps, self.cap)


def layer_optimizer(model: nn.Module, plan: LayerPlan, eta: float) -> torch.optim.SGD:
    """Plain SGD with one parameter group per layer of ``plan`` (all at ``eta`` until a rule sets them).

    Changing a group's ``lr`` is equivalent to rebuilding the optimizer, as the released code does,
    because SGD without momentum keeps no state."""
    return torch.optim.SGD(param_groups_by_lr(model, [(layer.params, eta) for layer in plan.layers]), lr=eta)


def tensor_grad_norms(groups: Sequence[Sequence[torch.Tensor]]) -> list[list[float]]:
    """L2 norm of every parameter's gradient (0 where it has none), grouped like ``groups``;
    computed in one batched call and read back with one device sync."""
    flat = [p for g in groups for p in g]
    with_grad = [p.grad for p in flat if p.grad is not None]
    norms = torch.stack(torch._foreach_norm(with_grad)).tolist() if with_grad else []
    it = iter(norms)
    values = [next(it) if p.grad is not None else 0.0 for p in flat]
    out, start = [], 0
    for g in groups:
        out.append(values[start:start + len(g)])
        start += len(g)
    return out


def lr_hook(optimizer: torch.optim.Optimizer, rule: LrRule) -> Callable[[int, int], None]:
    """A ``before_step(epoch, step)`` hook for :func:`flayer.train.sgd_epochs` that reads the
    gradients and sets each parameter group's learning rate by ``rule`` (every step, or at step 0
    of each epoch)."""
    groups = [list(g["params"]) for g in optimizer.param_groups]

    def before_step(epoch: int, step: int) -> None:
        if rule.every == "epoch" and step != 0:
            return
        for group, lr in zip(optimizer.param_groups, rule.lrs(tensor_grad_norms(groups))):
            group["lr"] = lr

    return before_step
