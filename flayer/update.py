"""What a client uploads: per tensor, the changed positions and their deltas against the global model.

Arrays keyed by state-dict name. Positions are explicit (flat, strictly increasing int64) or absent
(``indices is None``: every position, dense) -- a mask is never inferred from values equal to 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: protocol imports this module, and a broker needs no torch
    import torch

__all__ = ["TensorDelta", "Update", "delta_update", "float_state", "state_numpy"]


@dataclass(frozen=True)
class TensorDelta:
    shape: tuple[int, ...]
    values: np.ndarray  # float32, one per sent position
    indices: np.ndarray | None = None  # flat positions, strictly increasing; None = dense

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def count(self) -> int:
        return int(self.values.size)

    def scaled(self, factor: float) -> TensorDelta:
        """The delta times ``factor``, multiplied in float64 and rounded to float32 after: a factor rounded to
        float32 first can be far off (below float32's smallest normal it keeps a few bits, and one under 2^-149
        becomes up to twice itself)."""
        return TensorDelta(self.shape, (self.values.astype(np.float64) * factor).astype(np.float32), self.indices)

    def to_dense(self) -> np.ndarray:
        """The delta as a dense array of ``shape`` (zeros where nothing was sent)."""
        if self.indices is None:
            return self.values.reshape(self.shape)
        out = np.zeros(self.numel, dtype=self.values.dtype)
        out[self.indices] = self.values
        return out.reshape(self.shape)


@dataclass(frozen=True)
class Update:
    deltas: Mapping[str, TensorDelta]
    num_samples: int  # the aggregation weight: the client's training-sample count
    info: Mapping[str, float] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return sum(d.count for d in self.deltas.values())

    @property
    def numel(self) -> int:
        return sum(d.numel for d in self.deltas.values())


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The federated part of a model: its floating-point state (parameters and BN statistics),
    detached fp32 CPU copies. Integer buffers (num_batches_tracked) stay on the device."""
    import torch

    return {k: v.detach().to("cpu", torch.float32).clone() for k, v in model.state_dict().items()
            if v.is_floating_point()}


def state_numpy(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def delta_update(local: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor],
                 masks: Mapping[str, torch.Tensor | None], num_samples: int,
                 info: Mapping[str, float] | None = None) -> Update:
    """Build the upload: for each tensor in ``masks``, local - global at the mask's flat positions
    (a sorted int64 tensor) or everywhere (``None``)."""
    import torch

    deltas: dict[str, TensorDelta] = {}
    for name, idx in masks.items():
        diff = (local[name].detach().to("cpu", torch.float32) - global_state[name].to(torch.float32)).reshape(-1)
        if idx is None:
            deltas[name] = TensorDelta(tuple(local[name].shape), diff.numpy().copy())
        else:
            idx = idx.to("cpu", torch.int64).reshape(-1)
            deltas[name] = TensorDelta(tuple(local[name].shape), diff[idx].numpy().copy(), idx.numpy().copy())
    return Update(deltas, int(num_samples), dict(info or {}))


def neutral_update(update: Update) -> Update:
    """``update``'s layout (its tensors and positions) with every value 0, weight 1 and no info: what a
    device sends in a private round whose local round went non-finite, so its failure does not show
    (docs/reference/private-fields.md)."""
    return Update({k: TensorDelta(d.shape, np.zeros(d.values.shape, np.float32), d.indices)
                   for k, d in update.deltas.items()}, 1, {})
