"""The dashboard in a real headless browser (chromium over the DevTools protocol), fed by a metrics file that
grows while the page is open; access tokens; the fleet view's states and progress."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Browser, needs_chromium

from coordinator.dashboard.fleet import FleetView
from coordinator.dashboard.server import DashboardServer, is_loopback
from coordinator.dashboard.watch import FleetWatch
from protocol import Plan, Status
from protocol.metrics_schema import MetricsFile, round_record, run_record

DEVICES = ["dev-a", "dev-b", "dev-c"]
TOKEN = "t0k3n-for-the-dashboard-test"


def _round(r: int, accepted: list[str], refusals: list[dict] | None = None) -> dict:
    rows = [{"id": d, "result": "accepted" if d in accepted else "refused" if refusals else "missing"}
            for d in DEVICES]
    return round_record("coordinator", time.time(), round=r, wall_s=1.0, selected=DEVICES, devices=rows,
                        refused={"norm": len(refusals)} if refusals else {}, bytes_up=1000 * r,
                        bytes_down=3000 * r, acc=0.3 + 0.2 * r, train_loss=1.0, closed="quorum", refusals=refusals)


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[DashboardServer, MetricsFile]]:
    metrics = MetricsFile(tmp_path / "metrics.jsonl", "w")
    metrics.write(run_record("coordinator", time.time(), "fedavg", 3, None))
    metrics.write(_round(1, DEVICES))
    watch = FleetWatch(None, tmp_path / "metrics.jsonl").start()
    deadline = time.monotonic() + 10
    while not watch.snapshot()["devices"] and time.monotonic() < deadline:  # the data the tests look for
        time.sleep(0.05)
    server = DashboardServer(watch, "127.0.0.1", 0, getattr(request, "param", None))
    server.serve_in_thread()
    yield server, metrics
    server.close()
    watch.stop()
    metrics.close()


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


ROWS = "[...document.querySelectorAll('#devices tbody tr')]"


@needs_chromium
def test_page_shows_rounds_devices_and_refusals_pushed_without_reload(served, tmp_path: Path) -> None:
    server, metrics = served
    b = Browser(tmp_path / "chromium")
    try:
        assert b.goto(server.url) == 200
        b.wait_js(f"{ROWS}.length === 3", 15, "the device table")
        assert b.js("document.getElementById('round').textContent") == "1"
        assert b.js("document.getElementById('acc-chart').dataset.rounds") == "1"
        b.js("window.sameDocument = true")  # gone if the page reloads
        metrics.write(_round(2, ["dev-a", "dev-b"], [{"reason": "norm", "detail": "dev-c round 2: norm 9e9",
                                                       "device": "dev-c"}]))
        b.wait_js("document.getElementById('round').textContent === '2'", 15, "round 2 pushed to the page")
        assert b.js("window.sameDocument") is True
        assert b.js("document.getElementById('acc-chart').dataset.rounds") == "1,2"
        assert b.js("[...document.querySelectorAll('#acc-chart circle')].map(c => c.dataset.round).join()") == "1,2"
        bars = b.js("[...document.querySelectorAll('#bytes-chart rect')].map(r => r.dataset.round + r.dataset.dir + "
                    "r.dataset.bytes).join()")
        assert bars == "1down3000,1up1000,2down6000,2up2000"
        rows = b.js(f"{ROWS}.map(r => [r.dataset.device, r.querySelector('.accepted').textContent, r.dataset.result])")
        assert rows == [["dev-a", "2", "accepted"], ["dev-b", "2", "accepted"], ["dev-c", "1", "refused"]]
        assert "norm" in b.js("document.getElementById('refusals').textContent")
        assert "norm 9e9" in b.js("document.getElementById('refusals').textContent")
        # sort by updates accepted (ascending, then descending) and filter
        b.js("document.querySelector('th[data-key=accepted]').click()")
        assert b.js(f"{ROWS}.map(r => r.dataset.device).join()") == "dev-c,dev-a,dev-b"
        b.js("document.querySelector('th[data-key=accepted]').click()")
        assert b.js(f"{ROWS}[2].dataset.device") == "dev-c"
        b.js("const f = document.getElementById('filter'); f.value = 'refused'; f.dispatchEvent(new Event('input'))")
        assert b.js(f"{ROWS}.map(r => r.dataset.device).join()") == "dev-c"
        shot = b.screenshot(tmp_path / "dashboard.png")
        print(f"dashboard screenshot: {shot}")
        assert shot.stat().st_size > 10_000
    finally:
        b.close()


@needs_chromium
@pytest.mark.parametrize("served", [TOKEN], indirect=True)
def test_a_missing_or_wrong_token_gets_401_and_no_data(served, tmp_path: Path) -> None:
    server, _ = served
    base = server.url.split("?")[0]
    for path in ("", "api/snapshot", "events", "app.js"):
        status, body = _get(base + path)
        assert status == 401 and b"dev-a" not in body, path
        status, body = _get(base + path + "?token=wrong-token-of-the-same-size!")
        assert status == 401 and b"dev-a" not in body, path
    status, body = _get(base + "api/snapshot", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and json.loads(body)["devices"][0]["id"] == "dev-a"
    assert _get(base + "api/snapshot?token=" + TOKEN, method="POST")[0] == 405  # read-only
    b = Browser(tmp_path / "chromium")
    try:
        assert b.goto(base) == 401
        assert "dev-a" not in b.js("document.documentElement.outerHTML")
        assert b.goto(base + "?token=nope") == 401
        assert b.goto(server.url) == 200  # the token once in the address; then the cookie carries it
        b.wait_js(f"{ROWS}.length === 3", 15, "the device table behind the token")
    finally:
        b.close()


def test_only_loopback_goes_without_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.org")


def _status(state: str, r: int, t: float) -> Status:
    return Status(r, state, t, {"link_kbps": 800.0})


def _plan(r: int, deadline: float, phase: str = "train") -> Plan:
    return Plan(r, tuple(DEVICES), deadline, "fedavg", {}, {}, "ab" * 16, 1, 10, phase=phase, rounds=3)


def test_fleet_view_states_and_round_progress() -> None:
    v = FleetView(stale_after_s=10, revoked=["dev-x"])
    v.on_plan(_plan(2, deadline=150.0))
    v.on_status("dev-a", _status("idle", 2, 100.0), 100.0)
    v.on_status("dev-b", _status("training", 2, 100.0), 100.0)
    v.on_status("dev-c", _status("online", 1, 50.0), 100.0, retained=True)  # retained and old: stale
    v.on_status("dev-x", _status("online", 2, 100.0), 100.0)
    assert [v.state_of(d, 101.0) for d in (*DEVICES, "dev-x")] == ["idle", "training", "offline", "revoked"]
    p = v.progress(101.0)
    assert (p["round"], p["selected"], p["done"], p["by_state"]) == (2, 3, 1, {"done": 1, "offline": 1,
                                                                                 "training": 1})
    v.on_status("dev-a", _status("idle", 2, 149.0), 149.0)  # heartbeats
    v.on_status("dev-b", _status("training", 2, 149.0), 149.0)
    assert v.state_of("dev-b", 151.0) == "late"  # past the deadline, not done
    assert v.state_of("dev-a", 151.0) == "idle"  # done before it
    v.on_status("dev-b", _status("offline", 2, 152.0), 152.0)
    assert v.state_of("dev-b", 152.0) == "offline"
    snap = v.snapshot(101.0)
    assert snap["devices"][0]["link_kbps"] == 800.0 and snap["states"]["revoked"] == 1
