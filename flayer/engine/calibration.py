"""Round 0, for strategies that configure themselves from the clients' data (PLayer-FL's split,
FLAYER's ``head = auto``): each client runs ``strategy.calibrate`` on the initial model; the server
resolves the reports with :func:`resolve_calibration`. The simulator runs both halves in process
(:func:`calibrate`); the coordinator collects the reports over MQTT (``coordinator.calibration``)
and resolves them with the same function."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flayer.strategies.base import RoundContext, Strategy
from flayer.train import ClientData

__all__ = ["CalibrationError", "calibrate", "resolve_calibration"]

log = logging.getLogger(__name__)


class CalibrationError(ValueError):
    """The calibration cannot be resolved (no report came, or the strategy refused them)."""


def resolve_calibration(strategy: Strategy, reports: Sequence[Mapping[str, float]],
                        weights: Sequence[float]) -> tuple[Strategy, dict[str, Any]]:
    """(the strategy configured by the reports, the resolved options)."""
    if not reports:
        raise CalibrationError("the calibration closed without a single report; check that the devices run "
                               "a build with this strategy's calibration")
    try:
        resolved = dict(strategy.resolve_calibration(list(reports), list(weights)))
        configured = strategy.with_options(resolved)
    except ValueError as exc:
        raise CalibrationError(f"the calibration reports were refused: {exc}") from exc
    if configured.needs_calibration():
        raise CalibrationError(f"strategy {strategy.name!r}: the calibration resolved {resolved}, which does not "
                               f"settle what it needs")
    log.info("calibration of %s resolved %s from %d report(s)", strategy.name, resolved, len(reports))
    return configured, resolved


def calibrate(strategy: Strategy, clients: Sequence[ClientData], global_state: Mapping[str, torch.Tensor],
              seed: int, device: torch.device = torch.device("cpu")) -> tuple[Strategy, dict[str, Any]]:
    """Round 0 in process: every client calibrates on the common initial model, then
    :func:`resolve_calibration`."""
    reports = []
    for i, data in enumerate(clients):
        ctx = RoundContext(round=0, client=i, seed=seed, device=device)
        reports.append(strategy.calibrate(global_state, data, ctx))
    return resolve_calibration(strategy, reports, [float(d.num_train) for d in clients])
