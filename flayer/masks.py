"""Layer-wise upload masks, FLAYER Eq. 5-9, as explicit index masks.

Layer i of L uploads the fraction ``UP_i = min(max(i/L, floor), cap)`` of its entries: those whose
absolute change during this round's local training is largest (Eq. 5-9; the paper's floor is 0.1
and its cap 1). Every mask is explicit: per tensor, the sorted int64 flat positions that are sent,
or ``None`` for "every position" -- never inferred from values equal to zero.

Rule for a layer with several tensors (weight and bias): its k = ceil(UP_i * n_i) entries are chosen
by top-k over the concatenation of the layer's parameter tensors, so a layer keeps exactly k entries
in total and they are the k largest |change| of the layer. Ties at the threshold go to the lower
position. Floating-point buffers (BatchNorm statistics) are not masked; they travel whole.

:func:`ref_masks` is the released code's rule (``flayer-ref``): per parameter tensor, not per layer.

Public positions (private rounds, docs/explanation/privacy.md): top-k over |change| is itself a release of
the device's data (which weights its data moved most). :func:`public_scores` replaces the scores by
uniform draws from a generator seeded by the round's public seed (run seed and round alone): the mask rules above then keep the
same per-layer counts (FLAYER's UP_i) at positions every device of the round shares and nobody's data
chose.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .layers import LayerPlan

__all__ = [
    "keep_count",
    "layer_masks",
    "mask_count",
    "public_scores",
    "ref_keep_fraction",
    "ref_masks",
    "ref_prune_count",
    "top_k_positions",
    "upload_fraction",
]

Mask = torch.Tensor | None


def public_scores(change: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Scores of the shapes of ``change`` drawn from ``seed`` -- the round's public seed, derived from the
    run seed and the round, never the client -- so the masks built from them depend on no device's data."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.rand(tuple(t.shape), generator=gen) for n, t in sorted(change.items())}


def upload_fraction(i: int, num_layers: int, floor: float = 0.1, cap: float = 1.0) -> float:
    """Eq. 5-9: ``UP_i = min(max(i / L, floor), cap)`` for layer i of L."""
    if num_layers < 1 or not 0.0 <= floor <= cap <= 1.0:
        raise ValueError(f"need L >= 1 and 0 <= floor <= cap <= 1, got L={num_layers}, floor={floor}, "
                         f"cap={cap}")
    return min(max(i / num_layers, floor), cap)


def top_k_positions(score: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 flat positions (a CPU tensor) of the ``k`` largest entries of ``score`` (ties: lower
    position first). O(n): numpy's introselect finds the k-th largest value, no sort (several times
    faster on the CPU than torch.kthvalue; a GPU score is copied to the CPU first, as the upload is)."""
    a = score.detach().reshape(-1).to("cpu", torch.float32).numpy()
    n = a.size
    if k >= n:
        return torch.arange(n, dtype=torch.int64)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    thr = np.partition(a, n - k)[n - k]  # the k-th largest value
    keep = a > thr
    missing = k - int(np.count_nonzero(keep))
    if missing > 0:
        keep[np.flatnonzero(a == thr)[:missing]] = True
    return torch.from_numpy(np.flatnonzero(keep).astype(np.int64, copy=False))


def _split_positions(pos: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Split sorted positions over a concatenation into per-tensor sorted positions."""
    bounds = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64, device=pos.device)
    cuts = torch.searchsorted(pos, bounds)
    return [pos[cuts[j]:cuts[j + 1]] - bounds[j] for j in range(len(sizes))]


def keep_count(up: float, n: int) -> int:
    """k = ceil(UP * n), ignoring binary rounding noise (0.3 * 10 is 3.0000000000000004 in floats)."""
    return min(n, math.ceil(up * n * (1.0 - 1e-12)))


def layer_masks(change: Mapping[str, torch.Tensor], plan: LayerPlan, floor: float = 0.1,
                cap: float = 1.0) -> dict[str, Mask]:
    """Eq. 5-9 for every layer of ``plan``: per parameter tensor, the positions to upload.

    ``change`` maps parameter names to |local - start of training| (or any score where larger means
    "send first"). A layer with UP_i = 1 sends every position (``None``); buffers are not included
    (they travel whole).
    """
    masks: dict[str, Mask] = {}
    num_layers = plan.num_layers
    for layer in plan.layers:
        up = upload_fraction(layer.index, num_layers, floor, cap)
        tensors = [change[p] for p in layer.params]
        sizes = [t.numel() for t in tensors]
        n = sum(sizes)
        k = keep_count(up, n)
        if k >= n:
            masks.update({p: None for p in layer.params})
            continue
        score = torch.cat([t.detach().reshape(-1).abs() for t in tensors]) if len(tensors) > 1 \
            else tensors[0].detach().reshape(-1).abs()
        pos = top_k_positions(score, k)
        for name, part in zip(layer.params, _split_positions(pos, sizes)):
            masks[name] = part
    return masks


def ref_keep_fraction(t: int, num_tensors: int, floor: float = 0.1, cap: float = 0.9) -> float:
    """The released code's keep fraction for parameter tensor ``t`` (0-based) of P:
    ``max(min(t / P, cap), floor)`` with cap 0.9 and floor 0.1."""
    return max(min(t / num_tensors, cap), floor)


def ref_prune_count(group_size: int, mask_ratio: float) -> int:
    """How many entries of a group (a k x k kernel, or a whole 1-D tensor) the released code drops:
    ``round(group_size * mask_ratio)`` (half to even), at least 1 and, when that leaves room, at most
    group_size - 1 (a 1x1 kernel therefore drops its only entry)."""
    if 1.0 / group_size <= mask_ratio <= (group_size - 1) / group_size:
        return int(round(group_size * mask_ratio))
    if mask_ratio < 1.0 / group_size:
        return 1
    return group_size - 1


def ref_masks(change: Mapping[str, torch.Tensor], params: Sequence[str], whole_tail: int = 2,
              floor: float = 0.1, cap: float = 0.9) -> dict[str, Mask]:
    """The released code's masks (``flayer-ref``), per parameter tensor t of P (0-based, model order).

    Keep fraction ``max(min(t/P, 0.9), 0.1)``; the last ``whole_tail`` tensors (the classifier's weight
    and bias: the code hard-codes 2) are kept whole. A 4-D (conv) weight is masked per k x k kernel:
    in every (out, in) kernel the ``ref_prune_count(k*k, 1 - keep)`` entries with the smallest |change|
    are dropped and the rest sent. A 1-D tensor (bias, BatchNorm weight) is masked as one vector the
    same way. 2-D weights (Linear, Embedding) and tensors of other ranks are sent whole.
    """
    num = len(params)
    masks: dict[str, Mask] = {}
    for t, name in enumerate(params):
        c = change[name].detach().cpu()
        mask_ratio = 1.0 - ref_keep_fraction(t, num, floor, cap)
        if t >= num - whole_tail or c.dim() not in (1, 4):
            masks[name] = None
            continue
        if c.dim() == 4:
            groups = c.abs().reshape(c.shape[0] * c.shape[1], -1)
            group_size = int(c.shape[2]) ** 2  # the released code assumes square kernels
        else:
            groups = c.abs().reshape(1, -1)
            group_size = int(c.shape[0])
        keep = group_size - ref_prune_count(group_size, mask_ratio)
        if keep <= 0:
            masks[name] = torch.zeros(0, dtype=torch.int64)
            continue
        cols = torch.topk(groups, keep, dim=1, sorted=False).indices
        rows = torch.arange(groups.shape[0], dtype=torch.int64).unsqueeze(1) * groups.shape[1]
        masks[name] = torch.sort((rows + cols).reshape(-1)).values
    return masks


def mask_count(masks: Mapping[str, Mask], shapes: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(positions sent, positions in total) over the tensors of ``masks``."""
    sent = total = 0
    for name, m in masks.items():
        n = math.prod(shapes[name])
        total += n
        sent += n if m is None else int(m.numel())
    return sent, total
