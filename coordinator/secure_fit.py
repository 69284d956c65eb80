"""The coordinator's choice of a secure round's keep fraction (:mod:`flayer.engine.secure_fit`).

At a secure round's opening the coordinator knows the selected devices' uplink rates (``info.uplink_kbps`` of
their status: ``[edge] uplink_kbps``, else each device's estimate from its acknowledged uploads) and the time
until the round's expected close (the plan's ``close_by`` when recent rounds give one, else the deadline). The
masked input goes after the key and share stages, so the time it plans on is that less one stage
(``secure_stage_s``), at least half of it. The budget is linkfit's rule at a low quantile of the rates; the plain
link fit's size at that budget comes from encoding an update of the round's layout with the plan's codec ladder
(the sizes follow the value count and the positions, not the values). docs/explanation/secure-aggregation.md,
"Fitted to the link".
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from flayer.engine.secure_fit import fitted_keep, secure_budget
from flayer.engine.secure_layout import Layout, unflatten
from flayer.privacy_config import PrivacySettings
from protocol import UpdateHeader, UpdateOptions, encode_update
from protocol.upload_cap import codec_ladder

from .config import FederationSettings

__all__ = ["plain_ladder", "round_keep", "selected_rates"]

log = logging.getLogger("coordinator.server")


def selected_rates(registry: Any, selected: tuple[str, ...]) -> list[float]:
    """The uplink rates (bytes/s) the selected devices' statuses report (the devices that report one)."""
    out = []
    for dev in selected:
        info = registry.get(dev)
        kbps = info.info.get("uplink_kbps") if info is not None else None
        if isinstance(kbps, (int, float)) and not isinstance(kbps, bool) and 0 < kbps < 1e9:
            out.append(float(kbps) * 1000 / 8)
    return out


def plain_ladder(layout: Layout, start: str, lowest: str, compress: bool, federation: str) -> list[int]:
    """The encoded sizes of a plain upload of ``layout``'s positions at each codec of the plan's ladder, highest
    first (values drawn at random: the sizes follow the count and the positions)."""
    values = np.random.default_rng(0).normal(0.0, 0.01, layout.n)  # protects nothing: stand-in values for a size
    update = unflatten(values, layout, 1)
    header = UpdateHeader(federation, 1, "sizing", "0" * 64)
    return [len(encode_update(update, header, UpdateOptions(codec, zstd=compress)))
            for codec in codec_ladder(start, lowest)]


def round_keep(settings: PrivacySettings, fs: FederationSettings, federation: str, registry: Any,
               selected: tuple[str, ...], layout: Layout, bits: int, neighbours: int,
               seconds: float) -> tuple[float, int]:
    """(the round's keep fraction, the budget it was fitted to; 0: no rate known, ``secure_keep`` alone);
    ``registry``: the devices' statuses (:class:`coordinator.registry.DeviceRegistry`; None: no rate known)."""
    s = settings
    time = max(seconds - s.secure_stage_s, seconds / 2)
    budget = secure_budget(selected_rates(registry, selected) if registry is not None else [], time)
    if budget <= 0:
        return s.secure_keep, 0
    ladder = plain_ladder(layout, fs.value_codec, fs.fit_lowest_codec, fs.compress, federation)
    keep = fitted_keep(layout.n, bits, neighbours, budget, ladder, s.secure_fit_factor, s.secure_keep,
                       min(s.secure_keep, fs.fit_min_keep))  # never below what a plain fit keeps
    return keep, budget
