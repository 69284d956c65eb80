"""The server step of private rounds: ``[privacy] server_lr`` and ``server_momentum`` (docs/explanation/privacy.md).

A private round publishes ``prev + (sum_k clip(Delta_k) + noise) / m`` (:class:`flayer.aggregate.DPSumAggregator`).
The server step treats that move, ``d = (sum + noise) / m``, as a pseudo-gradient and takes a step of its own
(FedAvgM, Hsu et al. 2019; the server optimizer of Reddi et al., ICLR 2021)::

    v <- beta * v + d
    next = prev + eta * v

It reads nothing but the noised average -- already published -- and its own state, itself a function of earlier
published models: post-processing, so it spends no epsilon (the accountant composes the noised sums alone). The
velocity ``v`` is carried from round to round, and the coordinator saves it with its state so a restart resumes
the same step (:meth:`ServerStep.state` / :meth:`ServerStep.load`). ``eta = 1, beta = 0`` is the plain average.

Why: the clip bounds each device's move by C, and the fixed denominator m divides their sum, so the published
move is much shorter than a non-private round's; ``eta`` lengthens it and ``beta`` keeps the direction the noise
averages out over rounds (the measurements: docs/results/privacy.md, "Where the points go").
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flayer.privacy_config import check_server_step

__all__ = ["ServerStep"]


class ServerStep:
    """``next = prev + eta * v``, ``v <- beta * v + (published - prev)`` per floating tensor (module docstring)."""

    def __init__(self, lr: float = 1.0, momentum: float = 0.0) -> None:
        check_server_step(lr, momentum)
        self.lr, self.momentum = float(lr), float(momentum)
        self.velocity: dict[str, np.ndarray] = {}

    @property
    def plain(self) -> bool:
        """The plain average (eta 1, beta 0): :meth:`apply` returns the published model as it is."""
        return self.lr == 1.0 and self.momentum == 0.0

    def apply(self, prev: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The next global model from the previous one and the round's noised average (its own ``prev + d``)."""
        if self.plain:
            return dict(averaged)
        out: dict[str, torch.Tensor] = {}
        for name, new in averaged.items():
            old = prev.get(name)
            if old is None or not new.is_floating_point() or tuple(old.shape) != tuple(new.shape):
                out[name] = new
                continue
            p = old.detach().cpu().numpy().astype(np.float64)
            d = new.detach().cpu().numpy().astype(np.float64) - p
            v = self.velocity.get(name)
            v = d if v is None or v.shape != d.shape else self.momentum * v + d
            if self.momentum > 0:
                self.velocity[name] = v
            with np.errstate(over="ignore", invalid="ignore"):  # non-finite: the caller's divergence check
                out[name] = torch.from_numpy((p + self.lr * v).astype(np.float32))
        return out

    def state(self) -> dict[str, Any]:
        """What a restart needs, JSON-ready: eta, beta and the velocity (each tensor's shape and its float32
        values, little-endian, base64)."""
        return {"lr": self.lr, "momentum": self.momentum,
                "velocity": {k: {"shape": list(v.shape),
                                 "values": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")}
                             for k, v in self.velocity.items()}}

    def load(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state`: the velocity is kept only when eta and beta are the ones saved (a changed
        step starts afresh); ValueError on a malformed or non-finite saved velocity."""
        if not isinstance(state, Mapping):
            raise ValueError("server step state must be a mapping")
        if state.get("lr") != self.lr or state.get("momentum") != self.momentum:
            self.velocity = {}
            return
        velocity = state.get("velocity", {})
        if not isinstance(velocity, Mapping):
            raise ValueError("server step state: velocity must be a mapping")
        loaded: dict[str, np.ndarray] = {}
        for name, entry in velocity.items():
            try:
                shape = tuple(int(x) for x in entry["shape"])
                raw = base64.b64decode(entry["values"], validate=True)
                values = np.frombuffer(raw, dtype="<f4").astype(np.float64).reshape(shape)
            except (KeyError, TypeError, ValueError, binascii.Error) as exc:
                raise ValueError(f"server step state: velocity {name!r} is malformed ({exc})") from None
            if not np.isfinite(values).all():
                raise ValueError(f"server step state: velocity {name!r} holds non-finite values")
            loaded[str(name)] = values
        self.velocity = loaded
