"""The coordinator's Prometheus exporter (coordinator.exporter): the registry's values after fed events, the
closed set of refusal reasons, bounded labels, and the endpoint's access rule (transport.access)."""

from __future__ import annotations

import math
import re
import stat
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.exporter import (
    MAX_LABELS,
    NOT_REFUSALS,
    REFUSAL_REASONS,
    FleetMetrics,
    MetricsServer,
    read_token,
)
from coordinator.metrics import RoundStats
from coordinator.registry import DeviceRegistry
from protocol import Status

ROOT = Path(__file__).resolve().parents[2]


def _fleet(**kw: Any) -> FleetMetrics:
    return FleetMetrics("fed", "fedavg", "sync", 60.0, 1000, min_interval_s=0.0, **kw)


def _value(m: FleetMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def _record(r: int, accepted: list[str], selected: list[str], late: list[str] = ()) -> dict[str, Any]:
    """A round record made the way the coordinator makes it (coordinator.metrics.RoundStats)."""
    stats = RoundStats(r, selected, opened_at=100.0 * r, bytes_in=1000, bytes_out=5000)
    for c in late:
        stats.refuse("late", f"{c} was late", c)
    stats.tally.accepted = len(accepted)
    return stats.as_dict(100.0 * r + 7.5, "quorum", {"late": len(late)}, accepted)


def test_a_closed_round_record_feeds_the_round_counters() -> None:
    m = _fleet()
    m.restored(2, 50.0)  # a checkpoint after round 2: the file already holds two round lines
    assert _value(m, "flayer_rounds_total") == 2
    m.round_closed(_record(3, ["a", "b"], ["a", "b", "c", "d"], late=["c"]))
    assert _value(m, "flayer_rounds_total") == 3
    assert _value(m, "flayer_updates_accepted_total") == 2
    assert _value(m, "flayer_round_duration_seconds_count") == 1
    assert _value(m, "flayer_round_duration_seconds_sum") == pytest.approx(7.5)
    assert _value(m, "flayer_round_duration_seconds_bucket", le="10.0") == 1
    assert _value(m, "flayer_round_duration_seconds_bucket", le="5.0") == 0
    assert _value(m, "flayer_bytes_up_total") == 1000 and _value(m, "flayer_bytes_down_total") == 5000
    got = {r: _value(m, "flayer_last_round_devices", result=r) for r in ("accepted", "late", "missing", "refused")}
    assert got == {"accepted": 2, "late": 1, "missing": 1, "refused": 0}
    assert _value(m, "flayer_last_round_closed_timestamp_seconds") == pytest.approx(307.5)


def test_refusals_are_the_coordinators_counters_by_reason() -> None:
    m = _fleet()
    assert all(_value(m, "flayer_updates_refused_total", reason=r) == 0 for r in REFUSAL_REASONS)  # from the start
    counters: Counter[str] = Counter(late=3, norm=1, clipped=2)
    m.counters(counters)
    counters.update(late=2, revoked=4, clipped=1)
    m.counters(counters)
    m.counters(counters)  # nothing new: nothing added
    assert _value(m, "flayer_updates_refused_total", reason="late") == 5
    assert _value(m, "flayer_updates_refused_total", reason="norm") == 1
    assert _value(m, "flayer_updates_refused_total", reason="revoked") == 4
    assert _value(m, "flayer_updates_clipped_total") == 3
    assert _value(m, "flayer_updates_refused_total", reason="clipped") is None  # accepted, not a refusal
    m.counters({"brand_new": 7})
    assert _value(m, "flayer_updates_refused_total", reason="brand_new") is None  # a closed set of label values


def test_every_counter_the_coordinator_counts_is_an_exported_reason() -> None:
    """A counter added to the coordinator or the engine without adding it to the exporter's set fails here."""
    names: set[str] = set()
    for folder in ("coordinator", "flayer/engine"):
        for path in (ROOT / folder).glob("*.py"):
            text = path.read_text()
            names |= set(re.findall(r'\.count\(\s*"([a-z_]+)"', text))
            names |= set(re.findall(r'counters\["([a-z_]+)"\]', text))
            names |= set(re.findall(r'refuse\(\s*"[a-z_]+",\s*"([a-z_]+)"', text))
            names |= set(re.findall(r'rejected\["([a-z_]+)"\]', text))
    assert {"late", "revoked", "queue_full", "clipped", "norm"} <= names  # the scan finds them
    assert names - set(REFUSAL_REASONS) - set(NOT_REFUSALS) == set()


def _coordinator(statuses: dict[str, dict[str, Any]], selected: set[str], accepted: set[str],
                 bound: float | None) -> Any:
    reg = DeviceRegistry(stale_after_s=90.0)
    for c, info in statuses.items():
        reg.observe(c, Status(1, "online", 1000.0, info), 1000.0)
    rnd = SimpleNamespace(number=4, selected=frozenset(selected), accepted=set(accepted),
                          ctx=SimpleNamespace(bounds=SimpleNamespace(norm_bound=bound)))
    return SimpleNamespace(counters=Counter(), events=SimpleNamespace(bytes=321), clock=lambda: 1001.0,
                           open=rnd, registry=reg, online=lambda now: reg.online(now))


def test_devices_online_selected_and_reporting_are_counted_by_label() -> None:
    m = _fleet()
    statuses = {"d1": {"label": "jetson"}, "d2": {"label": "jetson"}, "d3": {"label": "phone"}, "d4": {},
                "d5": {"label": "bad label!"}}
    m.sync(_coordinator(statuses, {"d1", "d3", "d4"}, {"d1"}, None))
    assert _value(m, "flayer_devices_online", label="jetson") == 2
    assert _value(m, "flayer_devices_online", label="phone") == 1
    assert _value(m, "flayer_devices_online", label="none") == 2  # no label, and one that is not a label
    assert _value(m, "flayer_devices_selected", label="jetson") == 1
    assert _value(m, "flayer_devices_reporting", label="jetson") == 1
    assert _value(m, "flayer_devices_reporting", label="phone") == 0
    assert _value(m, "flayer_open_round") == 4 and _value(m, "flayer_receive_queue_bytes") == 321
    assert _value(m, "flayer_norm_bound") == math.inf  # no bound
    m.sync(_coordinator({"d1": {"label": "jetson"}}, set(), set(), 12.5))
    assert _value(m, "flayer_devices_online", label="phone") is None  # no online device carries it: gone
    assert _value(m, "flayer_norm_bound") == 12.5
    rendered = m.registry.collect()
    assert not any("d1" in str(s.labels) for metric in rendered for s in metric.samples)  # no device ids


def test_label_values_are_bounded() -> None:
    m = _fleet()
    m.sync(_coordinator({f"d{i}": {"label": f"kind{i}"} for i in range(MAX_LABELS + 10)}, set(), set(), None))
    labels = {s.labels["label"] for metric in m.registry.collect() if metric.name == "flayer_devices_online"
              for s in metric.samples}
    assert len(labels) == MAX_LABELS + 2  # the first MAX_LABELS, "none" and "other"
    assert _value(m, "flayer_devices_online", label="other") == 10


def test_gauges_are_synced_at_most_every_min_interval() -> None:
    m = FleetMetrics("fed", "fedavg", "sync", 60.0, 1000, min_interval_s=3600.0)
    coord = _coordinator({}, set(), set(), None)
    coord.counters["late"] = 1
    m.sync(coord)
    coord.counters["late"] = 5
    m.sync(coord)  # within the interval: not yet
    assert _value(m, "flayer_updates_refused_total", reason="late") == 1
    m.sync(coord, force=True)
    assert _value(m, "flayer_updates_refused_total", reason="late") == 5


def test_async_settings_are_exported_only_in_async_mode() -> None:
    assert _value(_fleet(), "flayer_max_staleness") is None
    m = _fleet(max_staleness=4)
    assert _value(m, "flayer_max_staleness") == 4
    rec = _record(1, ["a"], ["a"])
    rec["staleness_mean"] = 1.5
    m.round_closed(rec)
    assert _value(m, "flayer_staleness_mean") == 1.5


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_endpoint_serves_the_registry_and_applies_the_token_rule() -> None:
    m = _fleet()
    m.restored(3, 0.0)
    open_server = MetricsServer(m.registry, "127.0.0.1", 0)
    token = "t" * 24
    locked = MetricsServer(m.registry, "127.0.0.1", 0, token)
    for s in (open_server, locked):
        s.serve_in_thread()
    try:
        assert open_server.token is None
        status, body = _get(open_server.url)
        assert status == 200 and b"flayer_rounds_total 3.0" in body
        assert _get(open_server.url.replace("/metrics", "/other"))[0] == 404
        assert open_server.wait_scrape(0, 1.0)
        assert _get(locked.url)[0] == 401
        assert _get(locked.url, "w" * 24)[0] == 401
        status, body = _get(locked.url, token)
        assert status == 200 and b'flayer_updates_refused_total{reason="revoked"} 0.0' in body
    finally:
        open_server.close()
        locked.close()
    with pytest.raises(ValueError, match="at least 16"):
        MetricsServer(m.registry, "127.0.0.1", 0, "short")


def test_off_loopback_a_token_is_required_and_kept_in_the_state_folder(tmp_path: Path) -> None:
    assert read_token(None, "127.0.0.1", tmp_path) is None
    first = read_token(None, "0.0.0.0", tmp_path / "state")
    saved = tmp_path / "state" / "metrics.token"
    assert first and len(first) >= 16 and saved.read_text().strip() == first
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert read_token(None, "0.0.0.0", tmp_path / "state") == first  # the same after a restart
    given = tmp_path / "token"
    given.write_text("x" * 20 + "\n")
    assert read_token(given, "10.0.0.1", tmp_path) == "x" * 20
    given.write_text("short\n")
    with pytest.raises(ValueError, match=r"metrics_token_file .*token: the access token must be at least 16"):
        read_token(given, "10.0.0.1", tmp_path)
    with pytest.raises(ValueError, match="metrics_token_file .*missing"):
        read_token(tmp_path / "missing", "10.0.0.1", tmp_path)
