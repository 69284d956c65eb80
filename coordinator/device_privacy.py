"""The devices' own privacy ledgers as their status messages report them (docs/explanation/privacy.md, "A
device's own budget"): how many devices count private contributions, the distribution of their own epsilon
(min, median, max) and how many are at their budget. ``flayer status``, the dashboard and the Prometheus
exporter show it beside the federation's epsilon. A status is a device's word, so each value is checked
(a number >= 0, the word ``"inf"`` for an infinite epsilon, a boolean) and one that is not is left out, never
trusted as a figure. An infinite epsilon stays in the figures: one such device makes the fleet's max ``"inf"``
(JSON has no infinity; the exporter's gauge reads it as +Inf)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.metrics_schema import epsilon_value

__all__ = ["device_privacy"]


def _epsilon(info: Mapping[str, Any]) -> float | None:
    v = info.get("dp_epsilon")
    if v == "inf":  # the word protocol.metrics_schema.epsilon_value writes for an infinite epsilon
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
        return None
    return float(v)


def device_privacy(infos: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``{"devices", "with_epsilon", "min", "median", "max", "infinite", "at_budget"}`` over the statuses that carry a
    ledger (``dp_rounds``); None when none does (not a private federation). min/median/max are None when no
    device reports an epsilon (no delta known to it); each is ``"inf"`` where infinite, ``infinite`` counts those
    devices."""
    ledgers = [i for i in infos if isinstance(i.get("dp_rounds"), int) and not isinstance(i.get("dp_rounds"), bool)]
    if not ledgers:
        return None
    eps = sorted(e for i in ledgers if (e := _epsilon(i)) is not None)
    return {"devices": len(ledgers), "with_epsilon": len(eps),
            "min": epsilon_value(eps[0]) if eps else None,
            "median": epsilon_value(statistics.median(eps)) if eps else None,
            "max": epsilon_value(eps[-1]) if eps else None, "infinite": sum(1 for e in eps if math.isinf(e)),
            "at_budget": sum(1 for i in ledgers if i.get("dp_at_budget") is True)}
