"""The fleet view shows a device that 'flayer broker revoke' shut out as ``revoked``, read from the broker's
``revoked.json`` (the coordinator's own list) as it changes."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from coordinator.dashboard.watch import FleetWatch
from protocol import Status


def _wait(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_revoked_device_shows_as_revoked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="coordinator.revocations")
    revoked = tmp_path / "revoked.json"
    watch = FleetWatch(None, None, revoked_file=revoked)
    now = time.time()
    for dev in ("dev-1", "dev-3"):
        watch.view.on_status(dev, Status(1, "idle", now, {}), now)
    watch.start()
    try:
        assert watch.view.state_of("dev-3", time.time()) == "idle"
        revoked.write_text(json.dumps({"dev-3": now}))
        assert _wait(lambda: watch.view.state_of("dev-3", time.time()) == "revoked"), watch.view.revoked
        states = {r["id"]: r["state"] for r in watch.view.snapshot(time.time())["devices"]}
        assert states == {"dev-1": "idle", "dev-3": "revoked"}
        good = revoked.stat().st_mtime_ns
        revoked.write_text("not json")  # a malformed list keeps the last good one
        os.utime(revoked, ns=(good + 2 * 10**9, good + 2 * 10**9))  # a change the mtime check sees
        assert _wait(lambda: any("unreadable" in r.getMessage() and str(revoked) in r.getMessage()
                                 for r in caplog.records)), "the changed list was not read again"
        assert watch.view.state_of("dev-3", time.time()) == "revoked" and watch.view.revoked == {"dev-3"}
    finally:
        watch.stop()
