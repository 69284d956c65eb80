"""The devices' own privacy ledgers as their statuses report them (coordinator.device_privacy), shown by the
dashboard's snapshot, ``flayer status`` and the Prometheus exporter beside the federation's epsilon; a status
value that is not a number >= 0 (or a boolean) is left out, never shown as a figure."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cli.status import device_privacy_line
from coordinator.dashboard.fleet import FleetView
from coordinator.device_privacy import device_privacy
from coordinator.exporter import FleetMetrics
from coordinator.metrics import RoundStats
from coordinator.registry import DeviceRegistry
from protocol import Status

EVERY = {"schema": "every round"}  # the participation schema the federation's epsilon assumes

INFOS: list[dict[str, Any]] = [
    {"device": "cpu", "dp_rounds": 2, "dp_epsilon": 1.5, "dp_at_budget": False},
    {"device": "cpu", "dp_rounds": 5, "dp_epsilon": 4.0, "dp_at_budget": True},
    {"device": "cpu", "dp_rounds": 3, "dp_epsilon": 2.5, "dp_at_budget": False},
    {"device": "cpu", "dp_rounds": 1, "dp_epsilon": "9", "dp_at_budget": "yes"},  # not numbers: left out
    {"device": "cpu"},  # no ledger (a device of an earlier release)
]


def test_the_distribution_over_devices() -> None:
    dp = device_privacy(INFOS)
    assert dp is not None and dp == {"devices": 4, "with_epsilon": 3, "min": 1.5, "median": 2.5, "max": 4.0,
                                    "infinite": 0, "at_budget": 1}
    assert device_privacy([{"device": "cpu"}]) is None  # not a private federation
    line = device_privacy_line(dp)
    assert "min 1.5, median 2.5, max 4 over 3" in line and "1 at their budget" in line and "4 counting" in line
    bare = device_privacy([{"dp_rounds": 1, "dp_at_budget": True}])
    assert bare is not None and "no epsilon reported" in device_privacy_line(bare)


def test_an_infinite_epsilon_makes_the_fleets_max_infinite() -> None:
    """A device that booked a round without countable noise reports ``dp_epsilon "inf"``: it stays in the figures
    (before, it dropped out and max showed the largest finite epsilon); any other string is still left out."""
    infos = INFOS + [{"dp_rounds": 1, "dp_epsilon": "inf", "dp_at_budget": False},
                     {"dp_rounds": 1, "dp_epsilon": "Infinity", "dp_at_budget": False}]
    dp = device_privacy(infos)
    assert dp is not None and dp["max"] == "inf" and dp["infinite"] == 1 and dp["with_epsilon"] == 4
    assert dp["min"] == 1.5 and dp["median"] == pytest.approx(3.25)
    line = device_privacy_line(dp)
    assert "max infinite over 4 (1 infinite)" in line
    m = FleetMetrics("fed", "fedavg", "sync", 60.0, 1000, min_interval_s=0.0)
    m.devices_privacy(infos)
    maxes = [s.value for fam in m.registry.collect() for s in fam.samples
             if s.name == "flayer_device_epsilon" and s.labels.get("stat") == "max"]
    assert maxes and all(math.isinf(v) for v in maxes), maxes  # +Inf on the gauge
    view = FleetView()
    for i, info in enumerate(infos):
        view.on_status(f"dev-{i}", Status(1, "idle", 10.0, info), 10.0)
    assert view.snapshot(11.0)["device_privacy"]["max"] == "inf"  # JSON has no infinity: the word


def test_the_dashboard_snapshot_carries_it() -> None:
    view = FleetView()
    for i, info in enumerate(INFOS):
        view.on_status(f"dev-{i}", Status(1, "idle", 10.0, info), 10.0)
    assert view.snapshot(11.0)["device_privacy"]["median"] == 2.5


def test_prometheus_exports_the_federations_and_the_devices_epsilon() -> None:
    m = FleetMetrics("fed", "fedavg", "sync", 60.0, 1000, min_interval_s=0.0)
    stats = RoundStats(1, ["a"], opened_at=100.0)
    rec = stats.as_dict(107.0, "quorum", {}, ["a"])
    m.round_closed(rec)
    assert m.registry.get_sample_value("flayer_privacy_epsilon", EVERY) is None  # not a private round: no gauge
    m.round_closed({**rec, "epsilon": 3.25, "delta": 1e-5})
    assert m.registry.get_sample_value("flayer_privacy_epsilon", EVERY) == 3.25
    assert m.registry.get_sample_value("flayer_privacy_delta") == 1e-5
    m.round_closed({**rec, "epsilon": "inf", "delta": 1e-5})
    assert math.isinf(m.registry.get_sample_value("flayer_privacy_epsilon", EVERY) or 0.0)
    reg = DeviceRegistry(30.0)
    for i, info in enumerate(INFOS):
        reg.observe(f"dev-{i}", Status(1, "idle", 10.0, info), 10.0)
    m.devices_privacy(reg.infos())
    got = {s: m.registry.get_sample_value("flayer_device_epsilon", {"stat": s, "against": "models"}) for s in ("min", "median", "max")}
    assert got == {"min": 1.5, "median": 2.5, "max": 4.0}
    assert m.registry.get_sample_value("flayer_devices_at_budget") == 1
    assert m.registry.get_sample_value("flayer_devices_counting_privacy") == pytest.approx(4)
