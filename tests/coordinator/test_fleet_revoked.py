"""The fleet view shows a device that 'flayer broker revoke' shut out as ``revoked``, read from the broker's
``revoked.json`` (the coordinator's own list) as it changes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from coordinator.dashboard.watch import FleetWatch
from protocol import Status


def _wait(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_revoked_device_shows_as_revoked(tmp_path: Path) -> None:
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
        revoked.write_text("not json")  # a malformed list keeps the last good one
        time.sleep(0.6)
        assert watch.view.state_of("dev-3", time.time()) == "revoked"
    finally:
        watch.stop()
