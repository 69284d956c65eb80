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

A report is a device's claim, screened like an update (docs/explanation/security-hostile-devices.md):

1. ``sample_weight`` must be a whole number in ``[1, MAX_SAMPLE_WEIGHT]`` (10^7: ten million training
   samples, far above any device's share; updates' weights are capped lower, at ``max_samples``).
2. Every other value must be a finite number, and -- when the calibration knows its strategy -- the
   report must be one the strategy accepts on its own (:func:`flayer.engine.calibration.screen_report`:
   for the sensitivity curve exactly ``layer.1..layer.L``, each within ``MAX_SENSITIVITY``).
   A report failing 1 or 2 is acked ``rejected`` with the reason (the server counts it as ``bad_message``);
   the device may send a corrected one.
3. :meth:`Calibration.resolve` screens every taken report again (a calibration built without its
   strategy took them unscreened), drops the refused ones with a warning, caps the weights at the
   runner-up's (:func:`flayer.engine.calibration.robust_weights`) and, when nothing usable is left or
   the reports do not settle the strategy, falls back to the strategy's fallback options
   (:func:`flayer.engine.calibration.fallback_calibration`, a one-layer head) with a warning. It raises
   only for a strategy that has no fallback.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flayer.engine.calibration import (
    CalibrationError,
    fallback_calibration,
    resolve_calibration,
    screen_report,
)
from flayer.strategies.base import Strategy

__all__ = ["MAX_SAMPLE_WEIGHT", "WEIGHT_KEY", "Calibration", "CalibrationError", "CalibrationPhase"]

log = logging.getLogger(__name__)

WEIGHT_KEY = "sample_weight"
MAX_SAMPLE_WEIGHT = 10**7  # rule 1: the most training samples one device's report may claim


@dataclass
class Calibration:
    selected: frozenset[str]
    deadline: float
    strategy: Strategy | None = None  # the strategy being calibrated: rule 2 screens each report on arrival
    reports: dict[str, dict[str, float]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, client: str, values: Mapping[str, float]) -> tuple[str, str]:
        """(ack status, reason) for a device's report: rules 1 and 2."""
        if client not in self.selected:
            return "not_selected", f"{client} is not selected for the calibration"
        if client in self.reports:
            return "duplicate", "the calibration report of this device was already taken"
        weight = values.get(WEIGHT_KEY, 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight != int(weight) or not 1 <= weight <= MAX_SAMPLE_WEIGHT:
            return "rejected", (f"{WEIGHT_KEY} must be a whole number of training samples in [1, "
                                f"{MAX_SAMPLE_WEIGHT:,}], got {weight!r}")
        report = {k: v for k, v in values.items() if k != WEIGHT_KEY}
        bad = next((k for k, v in report.items() if isinstance(v, bool) or not isinstance(v, (int, float))
                    or not math.isfinite(v)), None)
        if bad is not None:
            return "rejected", f"calibration report: {bad} must be a finite number, got {report[bad]!r}"
        if self.strategy is not None and (reason := screen_report(self.strategy, report)):
            return "rejected", f"calibration report refused: {reason}"
        self.reports[client] = report
        self.weights[client] = float(weight)
        return "accepted", ""

    def complete(self, now: float) -> bool:
        return len(self.reports) >= len(self.selected) or now >= self.deadline

    def resolve(self, strategy: Strategy) -> tuple[Strategy, dict[str, Any]]:
        """(the configured strategy, the resolved options): rule 3, then
        :func:`flayer.engine.calibration.resolve_calibration`."""
        usable = []
        for client in sorted(self.reports):
            if reason := screen_report(strategy, self.reports[client]):
                log.warning("calibration: the report of %s is refused: %s", client, reason)
            else:
                usable.append(client)
        if not usable:
            return fallback_calibration(strategy, f"no usable calibration report ({len(self.reports)} taken, "
                                                  f"{len(self.selected)} devices selected)")
        try:
            return resolve_calibration(strategy, [self.reports[c] for c in usable], [self.weights[c] for c in usable])
        except CalibrationError as exc:
            return fallback_calibration(strategy, str(exc))


class CalibrationPhase:
    """Round 0 at the coordinator: the calibration open now (``current``) and whether the federation has been
    calibrated (``done``: after a resolution, or a checkpoint, which exists only after one)."""

    def __init__(self, calibration_s: float) -> None:
        self.calibration_s = calibration_s
        self.current: Calibration | None = None
        self.done = False

    def needed(self, strategy: Strategy) -> bool:
        return not self.done and strategy.needs_calibration()

    def open(self, online: list[str], now: float, strategy: Strategy) -> Calibration:
        self.current = Calibration(frozenset(online), now + self.calibration_s, strategy)
        return self.current

    def report(self, client: str, values: Mapping[str, float]) -> tuple[str, str] | None:
        """(ack status, reason) of a device's round-0 report; None: no calibration open."""
        return None if self.current is None else self.current.add(client, values)

    def resolve(self, strategy: Strategy) -> tuple[Strategy, dict[str, Any], int]:
        """Close the calibration: (the strategy, the resolved options, the number of reports);
        :class:`CalibrationError` for a strategy without a fallback, ValueError for options a plan cannot carry."""
        cal, self.current = self.current, None
        assert cal is not None
        strategy, resolved = cal.resolve(strategy)
        bad = {k: v for k, v in resolved.items() if not isinstance(v, (str, int, float, bool))}
        if bad:
            raise ValueError(f"the calibration resolved options the round plan cannot carry: {bad}")
        self.done = True
        return strategy, resolved, len(cal.reports)
