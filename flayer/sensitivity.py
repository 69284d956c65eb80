"""PLayer-FL's federation sensitivity and its split rule (Elhussein & Gursoy, arXiv 2502.08829).

Metric (the paper's federation sensitivity, first-order pruning importance per parameter,
accumulated over layers): for layers k = 1..L of a :class:`~flayer.layers.LayerPlan`,

    I_k = (1 / n_k) * sum_{p in W_k} (theta_p * dL/dtheta_p)^2          (per-layer importance)
    F_l = sum_{k <= l} I_k                                               (federation sensitivity)

where W_k are layer k's *weight* tensors -- every trainable parameter except biases (names ending in
``bias``), as in the authors' released code -- n_k their total number of coordinates, and L the loss
of ONE random mini-batch, measured after ONE local epoch of independent training (no federation)
from the common initial model.

Split rule. The curve is normalised to end at 1 (``F_l / F_L``) so that clients whose loss scales
differ weigh alike; the server takes the sample-weighted mean of the clients' normalised curves.
The *jump* at layer l is the adjacent ratio ``r_l = F_l / F_{l-1}`` (l = 2..L), which equals
``1 + I_l / F_{l-1}``: how much layer l adds relative to everything below it. The split is placed
before the first layer whose ratio exceeds the threshold t: layers ``1..s`` (s = l - 1) are federated,
layers ``s+1..L`` stay local. When no ratio exceeds t, the split is placed before the largest ratio.

Default ``t = 1.1``: a layer is a jump when it adds more than 10% to the sensitivity accumulated
below it. The released code hard-codes the split per data set, so no threshold is published. On the
4-layer CNN the first convolution dominates the cumulative sum (few weights, large gradients), so the
curve is nearly flat through conv2 and fc1 and rises at the last layer: measured after one epoch from
the common initialisation (Dir(0.1), two initialisation seeds), the aggregated adjacent ratios were
1.00-1.01 / 1.00 / 1.15-1.18 on Fashion-MNIST (10,000 samples, 20 clients) and 1.01 / 1.02-1.03 /
1.31-1.34 on digits (5 clients). 1.1 sits between the flat part and the jump with margin on both sides; a larger
t (e.g. 2) never fires there and falls back to the largest ratio, which here is the same layer.

A report comes from a device, so the server checks it (:func:`report_curve`): exactly
``layer.1..layer.L``, each value finite, in ``[0, MAX_SENSITIVITY]``, the curve non-decreasing and not all
zero. When no report is usable the server falls back to :func:`fallback_report`: the curve whose only
jump is at the last layer, i.e. a one-layer head -- the split this rule chose on every model measured
above, and FLAYER's provisional head under ``head = auto``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import LayerPlan
from .train import Split, sgd_epochs

__all__ = [
    "DEFAULT_THRESHOLD",
    "MAX_SENSITIVITY",
    "aggregate_curves",
    "auto_head_layers",
    "calibration_report",
    "fallback_report",
    "federation_sensitivity",
    "layer_importance",
    "normalise_curve",
    "report_curve",
    "report_keys",
    "split_layer",
    "weight_tensors",
]

DEFAULT_THRESHOLD = 1.1
# F_l is a mean of (theta * dL/dtheta)^2 summed over layers: 1e20 means |theta * grad| ~ 1e10 per weight on
# average, a diverged model rather than a measurement (honest values after one epoch are ~1e-6..1e2), and a
# value far above it (up to fp32's 3.4e38) can only be a device's fabrication.
MAX_SENSITIVITY = 1e20
_KEY = "layer.{}"


def weight_tensors(plan: LayerPlan) -> list[tuple[str, ...]]:
    """Per layer, the parameter names the metric uses: every parameter except biases."""
    return [tuple(p for p in layer.params if not p.rsplit(".", 1)[-1].startswith("bias")) for layer in plan.layers]


def layer_importance(model: nn.Module, plan: LayerPlan) -> list[float]:
    """I_k = (1/n_k) * sum over layer k's weights of (theta * grad)^2, from the gradients already in
    ``model`` (call ``loss.backward()`` first). A layer without weights (only biases) scores 0."""
    named = dict(model.named_parameters())
    out = []
    for names in weight_tensors(plan):
        total, count = 0.0, 0
        for n in names:
            p = named[n]
            if p.grad is None:
                raise ValueError(f"parameter {n!r} has no gradient; run backward on the batch first")
            total += float((p.detach() * p.grad.detach()).double().pow(2).sum())
            count += p.numel()
        out.append(total / count if count else 0.0)
    return out


def federation_sensitivity(importance: Sequence[float]) -> list[float]:
    """F_l = sum_{k<=l} I_k (the paper's cumulative federation sensitivity)."""
    out, acc = [], 0.0
    for v in importance:
        acc += float(v)
        out.append(acc)
    return out


def normalise_curve(curve: Sequence[float]) -> list[float]:
    """``F_l / F_L``; raises ValueError for an empty, negative, non-finite or all-zero curve."""
    c = [float(v) for v in curve]
    if not c:
        raise ValueError("empty sensitivity curve")
    if any(not math.isfinite(v) or v < 0 for v in c):
        raise ValueError(f"sensitivity curve must hold finite non-negative values, got {c}")
    if any(b < a * (1 - 1e-9) for a, b in zip(c, c[1:])):
        raise ValueError(f"a cumulative sensitivity curve cannot decrease, got {c}")
    if c[-1] <= 0:
        raise ValueError("sensitivity curve is all zero (no gradient signal)")
    return [v / c[-1] for v in c]


def split_layer(curve: Sequence[float], threshold: float = DEFAULT_THRESHOLD) -> int:
    """Number of federated layers s (input side): the split sits just before the first layer l whose
    adjacent ratio F_l / F_{l-1} exceeds ``threshold`` (before the largest ratio when none does).
    A one-layer curve gives s = 0 (nothing to split). ``curve`` need not be normalised."""
    if not threshold > 1:
        raise ValueError(f"the jump threshold must be > 1 (a ratio of a non-decreasing curve), got {threshold}")
    c = normalise_curve(curve)
    if len(c) < 2:
        return 0
    ratios = [(b / a if a > 0 else math.inf) for a, b in zip(c, c[1:])]  # ratios[j] is the jump at layer j+2
    for j, r in enumerate(ratios):
        if r > threshold:
            return j + 1
    return max(range(len(ratios)), key=lambda j: ratios[j]) + 1


def auto_head_layers(curve: Sequence[float], threshold: float = DEFAULT_THRESHOLD) -> int:
    """How many layers stay local (the head, FLAYER's ``s`` for ``head = auto``): L - split."""
    return len(curve) - split_layer(curve, threshold)


def calibration_report(model: nn.Module, plan: LayerPlan, train: Split, lr: float, batch_size: int,
                       epochs: int, sensitivity_batch: int, device: torch.device,
                       generator: torch.Generator) -> dict[str, float]:
    """The client's half of the calibration: ``epochs`` (PLayer-FL: 1) of independent local SGD from
    ``model`` (the common initial model), then F_l on one random batch of ``sensitivity_batch``
    training samples. Returns ``{"layer.1": F_1, ..., "layer.L": F_L}``. ``model`` is trained in place."""
    if len(train) == 0:
        raise ValueError("a client without training samples cannot calibrate")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sgd_epochs(model, train, opt, epochs, batch_size, device, generator)
    idx = torch.randperm(len(train), generator=generator)[: max(1, min(sensitivity_batch, len(train)))]
    x, y = train.prepare(train.x[idx], device), train.y[idx].to(device)
    model.train()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    curve = federation_sensitivity(layer_importance(model, plan))
    model.zero_grad(set_to_none=True)
    return {_KEY.format(i + 1): v for i, v in enumerate(curve)}


def report_keys(num_layers: int) -> frozenset[str]:
    """The keys of a calibration report over ``num_layers`` layers: ``layer.1..layer.L``."""
    return frozenset(_KEY.format(i + 1) for i in range(num_layers))


def fallback_report(num_layers: int) -> dict[str, float]:
    """The report the server resolves when no device's report is usable: F = (1, ..., 1, 2), one jump (ratio 2)
    at the last layer, so :func:`split_layer` gives L - 1 for every threshold (a one-layer head)."""
    return {_KEY.format(i + 1): (2.0 if i == num_layers - 1 and num_layers > 1 else 1.0) for i in range(num_layers)}


def report_curve(report: Mapping[str, float], num_layers: int) -> list[float]:
    """Validate one client's report (exactly ``layer.1..layer.L``, finite, in ``[0, MAX_SENSITIVITY]``,
    non-decreasing, not all zero) and return its curve. Raises ValueError naming what is wrong."""
    expected = report_keys(num_layers)
    if set(report) != expected:
        missing, extra = sorted(expected - set(report)), sorted(set(report) - expected)
        raise ValueError(f"calibration report must hold layer.1..layer.{num_layers}; missing {missing}, "
                         f"unexpected {extra}")
    curve = []
    for i in range(num_layers):
        v = report[_KEY.format(i + 1)]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"calibration report: layer.{i + 1} must be a finite non-negative number, got {v!r}")
        if v > MAX_SENSITIVITY:
            raise ValueError(f"calibration report: layer.{i + 1} = {v:.3g} exceeds {MAX_SENSITIVITY:.0e}, the bound "
                             f"on a federation sensitivity (a diverged or fabricated measurement)")
        curve.append(float(v))
    normalise_curve(curve)  # checks monotone and non-zero
    return curve


def aggregate_curves(reports: Sequence[Mapping[str, float]], weights: Sequence[float],
                     num_layers: int) -> list[float]:
    """The server's curve: the ``weights``-weighted mean (sample counts) of the clients' normalised
    curves. Every report is validated first."""
    if not reports:
        raise ValueError("no calibration reports to aggregate")
    if len(reports) != len(weights):
        raise ValueError(f"{len(reports)} reports but {len(weights)} weights")
    if any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ValueError(f"calibration weights must be positive and finite, got {list(weights)}")
    total = float(sum(weights))
    out = [0.0] * num_layers
    for rep, w in zip(reports, weights):
        for i, v in enumerate(normalise_curve(report_curve(rep, num_layers))):
            out[i] += w * v / total
    return out
