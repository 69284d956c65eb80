"""Every epsilon the coordinator prints or exports names its adversary and the participation schema it assumes
(docs/reference/metrics.md, "Prometheus"; docs/explanation/privacy.md, "Who learns what"): the per-round console
line of ``flayer coordinator``, and the Prometheus gauges as a scraper reads them over HTTP."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import pytest

from cli.coordinator import _Display
from coordinator.exporter import FleetMetrics, MetricsServer
from coordinator.metrics import RoundStats

INFOS = [{"dp_rounds": 2, "dp_epsilon": 1.5, "dp_at_budget": False},
         {"dp_rounds": 3, "dp_epsilon": 2.5, "dp_at_budget": False}]


def _record(eps: Any, coord: Any, most: int | None = None, sep: int = 0) -> dict[str, Any]:
    """A private round's record as the coordinator writes it (coordinator.privacy's close)."""
    rec = RoundStats(1, ["a"], opened_at=100.0).as_dict(107.0, "quorum", {}, ["a"])
    return {**rec, "acc": None, "model_bytes": 10, "epsilon": eps, "epsilon_coordinator": coord, "delta": 1e-5,
            "dp_max_participations": most, "dp_min_separation": sep}


def test_the_console_line_names_both_adversaries_and_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    display = _Display(10)
    display.round(_record(3.94, "inf"))  # central mode, no schema
    line = capsys.readouterr().out
    assert "epsilon 3.94 against readers of the models and plans, infinite against the coordinator (every round)" \
        in line, line
    display.round(_record(2.5, 7.25, most=3, sep=5))  # local mode under a schema
    line = capsys.readouterr().out
    assert "epsilon 2.5 against readers of the models and plans, 7.25 against the coordinator " \
           "(3 in 10 rounds, 5 apart)" in line, line


def _scrape(m: FleetMetrics) -> str:
    server = MetricsServer(m.registry, "127.0.0.1", 0)
    server.serve_in_thread()
    try:
        with urllib.request.urlopen(server.url, timeout=10) as r:  # loopback: the test's own server
            return r.read().decode()
    finally:
        server.close()


def _samples(body: str, name: str) -> dict[str, float]:
    return {labels: float(v) for labels, v in re.findall(rf"^{name}{{(.*)}} (\S+)$", body, re.MULTILINE)}


def test_the_scraped_gauges_name_their_adversary_and_schema() -> None:
    m = FleetMetrics("fed", "fedavg", "sync", 60.0, 1000, privacy_mode="local", min_interval_s=0.0)
    m.round_closed(_record(2.5, 7.25, most=3, sep=5))
    m.devices_privacy(INFOS)
    body = _scrape(m)
    assert _samples(body, "flayer_privacy_epsilon") == {'schema="at most 3 rounds, 5 apart"': 2.5}, body
    assert _samples(body, "flayer_privacy_epsilon_coordinator") == {'schema="at most 3 rounds, 5 apart"': 7.25}
    assert re.search(r"# HELP flayer_privacy_epsilon .*against readers of the models", body)
    assert re.search(r"# HELP flayer_privacy_epsilon_coordinator .*against the coordinator", body)
    devices = _samples(body, "flayer_device_epsilon")
    assert devices == {'against="coordinator",stat="min"': 1.5, 'against="coordinator",stat="median"': 2.0,
                       'against="coordinator",stat="max"': 2.5}, devices
    # a record under another schema replaces the series: no figure stays under a schema it no longer assumes
    m.round_closed(_record(4.0, "inf"))
    body = _scrape(m)
    assert _samples(body, "flayer_privacy_epsilon") == {'schema="every round"': 4.0}, body
    assert _samples(body, "flayer_privacy_epsilon_coordinator") == {'schema="every round"': float("inf")}


def test_a_central_federations_devices_count_against_the_models_readers() -> None:
    m = FleetMetrics("fed", "fedavg", "sync", 60.0, 1000, min_interval_s=0.0)
    m.devices_privacy(INFOS)
    assert m.registry.get_sample_value("flayer_device_epsilon", {"stat": "max", "against": "models"}) == 2.5
