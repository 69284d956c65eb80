"""The devices' own privacy ledgers as their status messages report them (docs/explanation/privacy.md, "A
device's own budget"): how many devices count private contributions, the distribution of their own epsilon
(min, median, max) and how many are at their budget. ``flayer status``, the dashboard and the Prometheus
exporter show it beside the federation's epsilon. A status is a device's word, so each value is checked
(a number >= 0, a boolean) and one that is not is left out, never trusted as a figure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["device_privacy"]


def _epsilon(info: Mapping[str, Any]) -> float | None:
    v = info.get("dp_epsilon")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
        return None
    return float(v)


def device_privacy(infos: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``{"devices", "with_epsilon", "min", "median", "max", "at_budget"}`` over the statuses that carry a
    ledger (``dp_rounds``); None when none does (not a private federation). min/median/max are None when no
    device reports an epsilon (no delta known to it)."""
    ledgers = [i for i in infos if isinstance(i.get("dp_rounds"), int) and not isinstance(i.get("dp_rounds"), bool)]
    if not ledgers:
        return None
    eps = sorted(e for i in ledgers if (e := _epsilon(i)) is not None)
    return {"devices": len(ledgers), "with_epsilon": len(eps),
            "min": eps[0] if eps else None, "median": statistics.median(eps) if eps else None,
            "max": eps[-1] if eps else None,
            "at_budget": sum(1 for i in ledgers if i.get("dp_at_budget") is True)}
