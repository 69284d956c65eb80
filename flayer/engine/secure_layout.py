"""The common layout of a secure round: which coordinates every device's masked vector carries, in order.

Secure aggregation sums aligned vectors, so every device of a round must send its values at the same
positions: the round's public positions (FLAYER's per-layer fractions UP_i drawn from the round's
public seed, :func:`flayer.masks.public_scores`) or whole tensors (a strategy's shared layers, dense).
:func:`layout_of` reads the layout off a device's update -- a name, shape and position set per tensor,
in sorted name order -- and its :attr:`Layout.digest` is what devices and coordinator compare: a device
whose layout differs from the round's cannot join the sum (its vector would not line up), and is
counted as dropped. :func:`flatten` lays an update out as one vector, :func:`unflatten` turns the
round's unmasked sum back into an update at the same positions (docs/explanation/secure-aggregation.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flayer.update import TensorDelta, Update

__all__ = ["Layout", "flatten", "layout_of", "round_layout", "synthetic_client", "unflatten"]


@dataclass(frozen=True)
class Layout:
    """Per tensor (sorted by name): name, shape, and the flat positions sent (None: every position)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    indices: tuple[np.ndarray | None, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) if i is None else int(i.size)
                     for s, i in zip(self.shapes, self.indices))

    @property
    def n(self) -> int:
        """The vector length: coordinates every device of the round sends."""
        return sum(self.counts)

    @property
    def digest(self) -> str:
        """SHA-256 over names, shapes and positions: equal layouts, equal digests."""
        h = hashlib.sha256()
        for name, shape, idx in zip(self.names, self.shapes, self.indices):
            h.update(name.encode() + b"\0" + repr(tuple(shape)).encode() + b"\0")
            h.update(b"dense" if idx is None else np.ascontiguousarray(idx, dtype="<i8").tobytes())
            h.update(b"\1")
        return h.hexdigest()


def layout_of(update: Update) -> Layout:
    names = tuple(sorted(update.deltas))
    return Layout(names, tuple(tuple(update.deltas[n].shape) for n in names),
                  tuple(update.deltas[n].indices for n in names))


def flatten(update: Update, layout: Layout) -> np.ndarray:
    """``update``'s values in ``layout``'s order (float64); ValueError when its layout is another."""
    if layout_of(update).digest != layout.digest:
        raise ValueError("the update's positions are not the round's common layout")
    if not layout.names:
        return np.zeros(0, dtype=np.float64)
    return np.concatenate([np.asarray(update.deltas[n].values, dtype=np.float64).reshape(-1) for n in layout.names])


def unflatten(vector: np.ndarray, layout: Layout, num_samples: int,
              info: Mapping[str, float] | None = None) -> Update:
    """The update at ``layout``'s positions holding ``vector`` (float32 values)."""
    if vector.shape != (layout.n,):
        raise ValueError(f"vector of shape {vector.shape}, the layout holds {layout.n} coordinates")
    deltas: dict[str, TensorDelta] = {}
    at = 0
    for name, shape, idx, count in zip(layout.names, layout.shapes, layout.indices, layout.counts):
        deltas[name] = TensorDelta(shape, vector[at:at + count].astype(np.float32), idx)
        at += count
    return Update(deltas, num_samples, dict(info or {}))


def synthetic_client(spec: Any, samples: int = 2, seq_len: int = 8) -> Any:
    """A client of ``samples`` synthetic examples for ``spec``'s model (zeros; labels 0..): enough for one
    local round, which is all :func:`round_layout` needs."""
    import torch

    from flayer.train import ClientData, Split

    y = torch.arange(samples, dtype=torch.int64) % max(1, spec.num_classes)
    if spec.is_text:
        split = Split(torch.ones((samples, seq_len), dtype=torch.int64), y, None, None)
    else:
        c = spec.in_channels
        split = Split(torch.zeros((samples, c, spec.height, spec.width), dtype=torch.uint8), y,
                      torch.full((c,), 0.5), torch.full((c,), 0.5))
    return ClientData(split, split, split)


def round_layout(strategy: Any, global_state: Mapping[str, Any], round_: int, seed: int) -> Layout:
    """The layout every device's upload of round ``round_`` has: read off the strategy's upload after one local
    round on a synthetic client (:func:`synthetic_client`). A secure round's positions are data-independent
    (the round's public seed, or whole tensors), so any data gives the layout the devices' data gives; the
    coordinator states it in the plan and a device whose upload has another one cannot join the sum."""
    import torch

    from flayer.strategies.base import RoundContext

    from .client_step import client_round

    ctx = RoundContext(round=round_, client=0, seed=seed, device=torch.device("cpu"))
    with torch.random.fork_rng(devices=[]):
        _, result = client_round(strategy, global_state, strategy.initial_state(), synthetic_client(strategy.spec),
                                 ctx)
    assert result is not None
    return layout_of(result.update)
