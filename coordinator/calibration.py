"""Round 0: calibrating the strategy on the devices' data before round 1.

Some strategies decide part of their configuration from the clients' data (PLayer-FL's split,
FLAYER's ``head = auto``). A strategy asks for it with ``needs_calibration()``. The coordinator then
publishes the initial model and a plan of phase ``calibrate`` (round 0) that selects every online
device; each runs ``strategy.calibrate(global_state, data, ctx)`` -- the same call the in-process
simulator makes -- and sends its flat report as a Metrics message on ``metrics/<client>`` (round 0,
plus ``sample_weight``: its training-sample count). The coordinator acks each report; when every
selected device reported, or at ``calibration_s``, it folds them with
``strategy.resolve_calibration(reports, weights)`` into option updates and continues with
``strategy.with_options(resolved)``. The resolved options travel in every later plan and are kept
in the checkpoint, so a restarted coordinator does not calibrate again.

Strategies without a calibration (``needs_calibration()`` is False, the base class default) never
enter this phase.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flayer.engine import CalibrationError, resolve_calibration
from flayer.strategies.base import Strategy

__all__ = ["WEIGHT_KEY", "Calibration", "CalibrationError"]

WEIGHT_KEY = "sample_weight"


@dataclass
class Calibration:
    selected: frozenset[str]
    deadline: float
    reports: dict[str, dict[str, float]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, client: str, values: Mapping[str, float]) -> tuple[str, str]:
        """(ack status, reason) for a device's report."""
        if client not in self.selected:
            return "not_selected", f"{client} is not selected for the calibration"
        if client in self.reports:
            return "duplicate", "the calibration report of this device was already taken"
        weight = values.get(WEIGHT_KEY, 1.0)
        if not (math.isfinite(weight) and weight > 0):
            return "rejected", f"{WEIGHT_KEY} must be a positive number, got {weight}"
        self.reports[client] = {k: v for k, v in values.items() if k != WEIGHT_KEY}
        self.weights[client] = weight
        return "accepted", ""

    def complete(self, now: float) -> bool:
        return len(self.reports) >= len(self.selected) or now >= self.deadline

    def resolve(self, strategy: Strategy) -> tuple[Strategy, dict[str, Any]]:
        """(the configured strategy, the resolved options): :func:`flayer.engine.resolve_calibration`."""
        clients = sorted(self.reports)
        return resolve_calibration(strategy, [self.reports[c] for c in clients], [self.weights[c] for c in clients])
