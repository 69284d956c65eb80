"""The coordinator's choice of a secure round's keep fraction (:mod:`flayer.engine.secure_fit`).

At a secure round's opening the coordinator knows the selected devices' uplink rates (``info.uplink_kbps`` of
their status: ``[edge] uplink_kbps``, else each device's estimate from its acknowledged uploads) and the time
until the round's expected close (the plan's ``close_by`` when recent rounds give one, else the deadline). The
masked input goes after the key and share stages, so the time it plans on is that less one stage
(``secure_stage_s``), at least half of it. The budget is linkfit's rule at a low quantile of the rates; the plain
link fit's size at that budget comes from encoding an update of the round's layout with the plan's codec ladder
(the sizes follow the value count and the positions, not the values).

A selected device that fits its uploads but has measured no rate yet (``info.upload_fit`` without
``info.uplink_kbps``) sends, in a plain round, its whole upload at the lowest codec the plan allows
(:mod:`edge_client.linkfit`: nothing fitted, the lowest codec, so the first upload of a thin link is not the one
sure to be late). The plain size the cap compares with is then at most that size, the ladder's last: with rates
known too, the smaller of the two; with none, that size alone. docs/explanation/secure-aggregation.md, "Fitted to
the link".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from flayer.engine.secure_fit import fitted_keep, secure_budget
from flayer.engine.secure_layout import Layout, unflatten
from flayer.privacy_config import PrivacySettings
from protocol import UpdateHeader, UpdateOptions, encode_update
from protocol.upload_cap import codec_ladder

from .config import FederationSettings

__all__ = ["plain_ladder", "round_keep", "selected_rates", "unmeasured_fitting"]

log = logging.getLogger("coordinator.server")


def _reported_kbps(status: Mapping[str, Any]) -> float | None:
    """The uplink rate (kbit/s) a device's status reports, None when it reports none or a malformed one."""
    kbps = status.get("uplink_kbps")
    return float(kbps) if isinstance(kbps, (int, float)) and not isinstance(kbps, bool) and 0 < kbps < 1e9 else None


def selected_rates(registry: Any, selected: tuple[str, ...]) -> list[float]:
    """The uplink rates (bytes/s) the selected devices' statuses report (the devices that report one)."""
    out = []
    for dev in selected:
        info = registry.get(dev)
        kbps = _reported_kbps(info.info) if info is not None else None
        if kbps is not None:
            out.append(kbps * 1000 / 8)
    return out


def unmeasured_fitting(registry: Any, selected: tuple[str, ...]) -> int:
    """How many selected devices fit their uploads but report no rate (``info.upload_fit`` true, no valid
    ``info.uplink_kbps``): in a plain round each sends the lowest codec's size."""
    infos = [info.info for info in map(registry.get, selected) if info is not None]
    return sum(1 for status in infos if status.get("upload_fit") is True and _reported_kbps(status) is None)


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
    """(the round's keep fraction, the budget of the reported rates it was fitted to; 0: no rate known -- then
    ``secure_keep`` alone, unless a selected device fits without a rate: module docstring); ``registry``: the
    devices' statuses (:class:`coordinator.registry.DeviceRegistry`; None: nothing known)."""
    s = settings
    time = max(seconds - s.secure_stage_s, seconds / 2)
    budget = secure_budget(selected_rates(registry, selected) if registry is not None else [], time)
    unmeasured = unmeasured_fitting(registry, selected) if registry is not None else 0
    if budget <= 0 and not unmeasured:
        return s.secure_keep, 0
    ladder = plain_ladder(layout, fs.value_codec, fs.fit_lowest_codec, fs.compress, federation)
    room = budget
    if unmeasured:  # the plain size compared is at most the lowest codec's, what an unmeasured device sends
        ladder = ladder[-1:]
        room = budget if budget > 0 else math.ceil(s.secure_fit_factor * ladder[0]) + 1  # no rate: no time limit
    keep = fitted_keep(layout.n, bits, neighbours, room, ladder, s.secure_fit_factor, s.secure_keep,
                       min(s.secure_keep, fs.fit_min_keep))  # never below what a plain fit keeps
    if unmeasured:
        log.info("secure round fit: %d of %d selected devices fit their uploads with no rate measured yet (a plain "
                 "upload at %s, %d bytes): keep %.4f", unmeasured, len(selected), fs.fit_lowest_codec, ladder[0], keep)
    return keep, budget
