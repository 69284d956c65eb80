"""A coordinator that downgrades a device below the privacy floor its ``device.toml`` pins (docs/explanation/privacy.md,
"The privacy floor a device pins").

The adversary holds the coordinator's credentials on a real Mosquitto: it signs and publishes plans of its own
choosing selecting the device under attack, serves the model, acknowledges whatever arrives and reads the device's
update topic. The device is a real edge client over its own connection, its settings read from its own
``device.toml`` with ``[privacy] require = "secure"``. The guarantees:

- sent a plain central-mode plan, the same privacy in local mode with secure aggregation off, or a plan without any
  privacy, the device sends nothing on its update topic, its ledger books nothing, it logs one line a round naming
  its floor and what the plan asked, and it stays connected, answering each later plan;
- the control: devices whose ``device.toml`` requires ``["secure", "local"]`` take part in a real coordinator's
  secure round with distributed noise (their inputs in the unmasked sum, the round booked in each ledger).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from attacklib_secagg import kit_fleet, private_secure_rounds
from fedtestlib import start_fed_broker
from test_attack_participation_schema import _Adversary, _base

from edge_client.budget import DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol import Kind, decode_envelope

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DEVICE, Z, DELTA = "dev-floor", 1.0, 1e-3
NAMES = [f"dev-{i}" for i in range(4)]


def _device_toml(tmp: Path, creds: Path, require: str) -> Path:
    path = tmp / "device.toml"
    path.write_text(f'credentials = "{creds}"\n[data]\ndataset = "digits"\npartition_file = "unused.npz"\nclient = 0\n'
                    f'[edge]\nstate_dir = "{tmp / DEVICE}"\ndevice = "cpu"\nthreads = 1\nheartbeat_s = 1.0\n'
                    f'ack_timeout_s = 30.0\n[privacy]\nrequire = {require}\n')
    return path


def test_a_coordinator_cannot_downgrade_a_device_that_requires_secure_aggregation(
        tmp_path: Path, digits: Any, caplog: pytest.LogCaptureFixture) -> None:
    if not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    fb = start_fed_broker(tmp_path, "mosquitto", [DEVICE])
    settings = load_device_config(_device_toml(tmp_path, fb.state_dir / f"credentials/{DEVICE}.toml",
                                               '"secure"')).edge
    base, blob = _base(digits, DEVICE)
    shard = client_data(digits, make_partition(digits.y, 10, 3, "iid", 0).clients[0])
    adversary = _Adversary(fb, DEVICE, base, blob)
    device = EdgeClient(settings, fb.devices[DEVICE], shard)
    plans = [(1, {**RoundPrivacy("central", 0.5, Z, Z, 1).as_plan(), "delta": DELTA}),  # central mode, no secure sum
             (2, {**RoundPrivacy("local", 0.5, Z, Z, 1).as_plan(), "delta": DELTA}),  # local noise, secure sum off
             (3, {})]  # no privacy at all
    contributed: list[int] = []
    caplog.set_level(logging.INFO, logger="edge_client")
    try:
        device.start()
        for r, privacy in plans:
            if adversary.ask(r, privacy):
                contributed.append(r)
        updates = [m for m in adversary.rec.drain(2.0)
                   if m.payload and decode_envelope(m.payload).kind == Kind.UPDATE_CHUNK]
        assert device.error is None
        assert device.link.connected.is_set(), "the device left the federation instead of refusing the rounds"
    finally:
        device.stop()
        device.wait(30)
        adversary.close()
        fb.broker.stop()
    assert contributed == [], f"the device requiring secure aggregation contributed to downgraded rounds {contributed}"
    assert updates == [], f"{len(updates)} update chunk(s) reached the coordinator in the clear"
    assert DeviceLedger.from_extra(device.stored.extra).rounds == 0, "a refused round was booked"
    for r, _ in plans:  # one clear line a round, naming the floor and what the plan asked
        lines = [rec.getMessage() for rec in caplog.records if f"refusing round {r}:" in rec.getMessage()]
        assert len(lines) == 1 and 'require = "secure"' in lines[0] and "without secure aggregation" in lines[0], \
            f"round {r}: {lines}"


def test_devices_that_require_secure_local_noise_take_part_in_a_secure_round(tmp_path: Path, digits: Any) -> None:
    with kit_fleet(tmp_path, digits, NAMES, privacy='require = ["secure", "local"]') as (fb, devices):
        assert all(d.settings.privacy_require == ("local", "secure") for d in devices)
        rec = private_secure_rounds(tmp_path, fb, len(NAMES), rounds=1, stage_s=10.0, timeout=300)[0]
        assert rec["secure_abandoned"] is None, f"the round was not unmasked: {rec['secure_abandoned']}"
        assert sorted(rec["secure_survivors"]) == NAMES, f"not every device's input was in the sum: {rec}"
        for d in devices:
            assert DeviceLedger.from_extra(d.stored.extra).rounds == 1, f"{d.id} did not book the secure round"
