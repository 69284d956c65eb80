"""A device's status whose fields are not what they claim (docs/explanation/guarantees.md, "Bounds on a hostile
device or peer"; docs/howto/watch-fleet.md).

The adversary is a device with its own credentials: it publishes its own retained status, signed with its own key,
whose ``info`` says ``link_kbps = "fast"`` (a string where the view expects a number). The operator then runs
``flayer status`` and ``flayer status --watch`` as separate processes against a real Mosquitto. The guarantee:
both keep showing the fleet (the honest device with its link rate), name the device whose status is invalid and
why, and never stop with a traceback.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mqtt_broker import mosquitto_available
from protocol import Status, Topics, encode_message
from transport.credentials import mqtt_connect_settings
from transport.link import Connected, MqttLink

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "stest"
ROOT = Path(__file__).resolve().parents[2]


def _publish_status(creds, info: dict) -> None:  # type: ignore[no-untyped-def]
    events: queue.Queue = queue.Queue()
    link = MqttLink(mqtt_connect_settings(creds), events.put, clean_session=True)
    link.start()
    try:
        ev = events.get(timeout=10)
        assert isinstance(ev, Connected) and ev.ok, ev
        payload = encode_message(Status(1, "idle", time.time(), info), FED, creds.username, key=creds.signer())
        assert link.wait_published([link.publish(Topics(FED).status(creds.username), payload, retain=True)], 10)
    finally:
        link.stop()


def _status(state: Path, *flags: str, watch_s: float = 0.0) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "cli.main", "status", "--broker-state", str(state), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if watch_s:
        time.sleep(watch_s)
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def test_a_device_status_with_a_bad_field_does_not_stop_the_fleet_view(attack_fed: Any) -> None:
    fed = attack_fed(["dev-b"], adversary="dev-a", view="device", federation=FED)  # dev-a: its own account
    state, devs = fed.state_dir, fed.devices
    _publish_status(devs["dev-a"], {"link_kbps": "fast"})  # the adversary's own status
    _publish_status(devs["dev-b"], {"link_kbps": 1234.5})
    rc, out = _status(state)
    assert rc == 0 and "Traceback" not in out, (rc, out)
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip().startswith("dev-")}
    assert "1234" in rows["dev-b"], out  # the honest device is shown
    assert "dev-a: invalid status: link_kbps 'fast' is not a number >= 0" in out, out
    rc, out = _status(state, "--watch", "--interval", "0.5", watch_s=6.0)
    assert "Traceback" not in out and rc == 0, (rc, out[-2000:])
    assert out.count("dev-a: invalid status") >= 2 and "1234" in out, out[-2000:]  # redrawn, both shown
