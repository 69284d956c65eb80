"""Performance-guided head initialisation (PLA), FLAYER Eq. 2.

After the download, a client's body takes the global values and its head mixes its own previous
head with the global one, weighted by A_l, the accuracy its personal model reached on its
validation hold-out (never its test split):

    body  <- global
    head  <- A_l * local_head + (1 - A_l) * global_head

A client that has no head yet (first participation) uses A_l = 0, i.e. the global head.
Pure functions over tensors keyed by state-dict name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["pla_mix", "pla_state"]


def pla_mix(local_head: Mapping[str, torch.Tensor], global_head: Mapping[str, torch.Tensor],
            acc: float) -> dict[str, torch.Tensor]:
    """Eq. 2, head part: ``acc * local + (1 - acc) * global`` for every tensor of ``global_head``.

    ``acc`` (A_l) must lie in [0, 1]. ``acc == 0`` returns the global tensors' values and ``acc == 1``
    the local ones, exactly (no rounding from the blend). Tensors missing from ``local_head`` take
    the global value.
    """
    if not (math.isfinite(acc) and 0.0 <= acc <= 1.0):
        raise ValueError(f"PLA weight A_l must be in [0, 1], got {acc}")
    out: dict[str, torch.Tensor] = {}
    for name, g in global_head.items():
        loc = local_head.get(name)
        if loc is not None and tuple(loc.shape) != tuple(g.shape):
            raise ValueError(f"PLA: local head tensor {name!r} has shape {tuple(loc.shape)}, "
                             f"global {tuple(g.shape)}")
        if loc is None or acc == 0.0:
            out[name] = g.detach().clone()
        elif acc == 1.0:
            out[name] = loc.detach().to(g.device, g.dtype).clone()
        else:
            out[name] = acc * loc.detach().to(g.device, g.dtype) + (1.0 - acc) * g.detach()
    return out


def pla_state(global_state: Mapping[str, torch.Tensor], local_head: Mapping[str, torch.Tensor],
              head: tuple[str, ...], acc: float) -> dict[str, torch.Tensor]:
    """Eq. 2 on a whole state: the global state with the tensors named in ``head`` replaced by
    :func:`pla_mix` of the client's ``local_head`` and the global head."""
    unknown = [n for n in head if n not in global_state]
    if unknown:
        raise KeyError(f"PLA: head tensors {unknown[:4]} are not in the global state")
    mixed = pla_mix(local_head, {n: global_state[n] for n in head}, acc)
    return {**global_state, **mixed}
