"""Round 0, for strategies that configure themselves from the clients' data (PLayer-FL's split,
FLAYER's ``head = auto``): each client runs ``strategy.calibrate`` on the initial model; the server
resolves the reports with :func:`resolve_calibration`. The simulator runs both halves in process
(:func:`calibrate`); the coordinator collects the reports over MQTT (``coordinator.calibration``)
and resolves them with the same function.

Rules for reports that come from devices (the coordinator's side, docs/explanation/security-hostile-devices.md):

1. :func:`screen_report`: one report is usable when the strategy's own resolution accepts it alone (for
   the sensitivity curve: exactly ``layer.1..layer.L``, finite, within ``MAX_SENSITIVITY``, non-decreasing).
2. :func:`robust_weights`: no report weighs more than the second-heaviest one (the heaviest claim is cut
   to the runner-up's), so one device's sample count cannot outweigh every other report.
3. :func:`fallback_calibration`: when nothing usable came, or the reports do not settle the strategy, the
   options of the fallback curve (:func:`flayer.sensitivity.fallback_report`: a one-layer head) -- the run
   goes on, with a warning, instead of stopping.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from flayer.layers import LayerPlan
from flayer.sensitivity import fallback_report
from flayer.strategies.base import RoundContext, Strategy
from flayer.train import ClientData

__all__ = ["CalibrationError", "calibrate", "fallback_calibration", "resolve_calibration", "robust_weights",
           "screen_report"]

log = logging.getLogger(__name__)


class CalibrationError(ValueError):
    """The calibration cannot be resolved (no report came, or the strategy refused them)."""


# what a strategy's resolution may raise for a report it cannot use (a device's bytes: never a crash)
_REFUSALS = (ValueError, ArithmeticError, LookupError, TypeError)


@runtime_checkable
class _LayerPlanned(Protocol):
    """A strategy whose calibration is the sensitivity curve over its layer plan (PLayer-FL, FLAYER auto)."""

    plan: LayerPlan


def screen_report(strategy: Strategy, report: Mapping[str, float]) -> str:
    """Rule 1: ``""`` when ``strategy`` accepts ``report`` on its own, else the reason it does not."""
    try:
        strategy.with_options(strategy.resolve_calibration([report], [1.0]))
    except _REFUSALS as exc:
        return str(exc) or type(exc).__name__
    return ""


def robust_weights(weights: Sequence[float]) -> list[float]:
    """Rule 2: every weight capped at the second-largest (one weight alone is kept as it is)."""
    w = [float(x) for x in weights]
    if len(w) < 2:
        return w
    cap = sorted(w)[-2]
    return [min(x, cap) for x in w]


def fallback_calibration(strategy: Strategy, why: str) -> tuple[Strategy, dict[str, Any]]:
    """Rule 3: the strategy resolved from :func:`flayer.sensitivity.fallback_report` over its layer plan.
    Raises CalibrationError for a strategy without a layer plan (nothing to fall back to)."""
    if not isinstance(strategy, _LayerPlanned):
        raise CalibrationError(f"{why}; strategy {strategy.name!r} has no fallback for its calibration")
    report = fallback_report(strategy.plan.num_layers)
    try:
        configured, resolved = _resolve(strategy, [report], [1.0])
    except CalibrationError as exc:
        raise CalibrationError(f"{why}; the fallback failed too: {exc}") from None
    log.warning("calibration of %s: %s; falling back to %s (a one-layer head)", strategy.name, why, resolved)
    return configured, resolved


def resolve_calibration(strategy: Strategy, reports: Sequence[Mapping[str, float]],
                        weights: Sequence[float]) -> tuple[Strategy, dict[str, Any]]:
    """(the strategy configured by the reports, the resolved options), the weights made robust (rule 2)."""
    if not reports:
        raise CalibrationError("the calibration closed without a single report; check that the devices run "
                               "a build with this strategy's calibration")
    return _resolve(strategy, reports, robust_weights(weights))


def _resolve(strategy: Strategy, reports: Sequence[Mapping[str, float]],
             weights: Sequence[float]) -> tuple[Strategy, dict[str, Any]]:
    try:
        resolved = dict(strategy.resolve_calibration(list(reports), list(weights)))
        configured = strategy.with_options(resolved)
    except _REFUSALS as exc:
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
