"""``flayer emulate --dashboard`` watched in a real headless browser: a 4-device fleet runs 3 rounds while one
page stays open; the page must show every device with what the coordinator reports, a round counter that
advances and charts holding the rounds closed so far. ``flayer status`` is asked about the same fleet while
it runs and after it stopped."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from emutestlib import ROOT, emulate, finish, wait_until

from protocol.metrics_schema import MetricsSchemaError, read_metrics
from tests.coordinator.browser import Browser, needs_chromium

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs_chromium]
STATES = {"online", "idle", "training", "uploading", "late", "offline"}
DOM = """(() => ({
  round: document.getElementById('round').textContent,
  acc: document.getElementById('acc-chart').dataset.rounds || '',
  bytes: [...document.querySelectorAll('#bytes-chart rect')].map(r => r.dataset.round + r.dataset.dir),
  rows: [...document.querySelectorAll('#devices tbody tr')].map(r => ({id: r.dataset.device, state: r.dataset.state,
          result: r.dataset.result, accepted: Number(r.querySelector('.accepted').textContent)})),
}))()"""


def _closed(out: Path) -> list[dict[str, Any]]:
    try:
        return [r for r in read_metrics(out / "coordinator/metrics.jsonl") if r["kind"] == "round"]
    except MetricsSchemaError:
        return []  # not written yet


def _status(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", "status", str(out), "--timeout", "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_dashboard_follows_an_emulated_fleet_in_a_browser(tmp_path: Path) -> None:
    out, log = tmp_path / "run", tmp_path / "emulate.log"
    proc = emulate(["--dataset", "digits", "--strategy", "fedavg", "--partition", "iid", "--lr", "0.05", "--clients",
                    "4", "--rounds", "3", "--quorum", "4", "--over-selection", "1.0", "--min-devices", "4",
                    "--heartbeat", "1", "--federation", "dash4", "--out", str(out), "--timeout", "240",
                    "--dashboard", "127.0.0.1:0"], log)
    browser = None
    samples: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    running_status = None
    try:
        wait_until(lambda: "dashboard: http" in log.read_text(), 120, "the dashboard's address")
        url = re.search(r"dashboard: (http://\S+)", log.read_text()).group(1)  # type: ignore[union-attr]
        browser = Browser(tmp_path / "chromium")
        assert browser.goto(url) == 200
        shot = None
        while proc.poll() is None:
            dom = browser.js(DOM)
            samples.append((dom, _closed(out)))  # the coordinator's own file, read after the page
            if running_status is None and len(samples[-1][1]) >= 1:
                running_status = _status(out)
            if shot is None and dom["acc"].count(",") >= 1:
                shot = browser.screenshot(tmp_path / "dashboard-emulate.png")
                print(f"dashboard screenshot: {shot}")
            time.sleep(0.3)
    finally:
        if browser is not None:
            browser.close()
        rc = finish(proc, 240)
    assert rc == 0, log.read_text()[-3000:]
    closed = _closed(out)
    devices = sorted(closed[0]["selected"])
    assert len(closed) == 3 and len(devices) == 4
    # the round counter advanced while the page stayed open
    rounds = [int(d["round"]) for d, _ in samples if d["round"].isdigit()]
    assert rounds == sorted(rounds) and len(set(rounds)) >= 2, rounds
    for dom, coord in samples:
        shown = [int(x) for x in dom["acc"].split(",") if x]
        # charts hold exactly the rounds closed so far (a prefix of what the coordinator wrote by then)
        assert shown == list(range(1, len(shown) + 1)) and len(shown) <= len(coord), (shown, len(coord))
        assert dom["bytes"] == [f"{r}{d}" for r in shown for d in ("down", "up")]
        assert {r["id"] for r in dom["rows"]} <= set(devices)  # devices appear as they connect...
        assert all(r["state"] in STATES for r in dom["rows"]), dom["rows"]
        if shown:  # ...all of them once a round closed, each agreeing with the coordinator's records
            assert sorted(r["id"] for r in dom["rows"]) == devices
            for row in dom["rows"]:
                results = [next(d["result"] for d in coord[r - 1]["devices"] if d["id"] == row["id"]) for r in shown]
                assert row["accepted"] == results.count("accepted") and row["result"] == results[-1], row
    assert max(len(d["acc"].split(",")) for d, _ in samples if d["acc"]) >= 2
    assert shot is not None and shot.stat().st_size > 10_000
    # flayer status while the fleet ran, and after it stopped
    assert running_status is not None and running_status.returncode == 0, running_status
    assert all(d in running_status.stdout for d in devices) and "federation dash4" in running_status.stdout
    stopped = _status(out)
    assert stopped.returncode == 1 and "the fleet is stopped" in stopped.stderr, stopped
