"""A survivor set shown to a device without itself after its consent leaves its booking in place
(docs/explanation/secure-aggregation.md, "When a device books a secure round").

The adversary is the coordinator: its own credentials and the messages it signs to each device. A private secure
round (distributed DP, every device's ledger counting it) runs over a real Mosquitto with real edge clients until
the masked inputs are in. Then the coordinator shows the victim the survivor set without the victim, and every other
device the whole set with it: the victim signs as a witness, the others give T signatures over the set holding it,
and the victim's neighbours reveal shares of its self-mask seed, so the sum unmasked holds the victim's input.
On an earlier release, the victim's device took its provisional booking back the moment it signed the set without
itself: its ledger counted no round while its input was in a revealed sum. The booking now happens at the victim's
consent, before the survivor set is shown, and nothing takes it back.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from fedtestlib import device_toml, federation_toml, finished, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.budget import DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.partition import make_partition, save_partition
from flayer.secagg import SecAggServer, SurvivorSignature
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from mqtt_broker.kit import write_kit
from protocol.metrics_schema import read_metrics
from transport.credentials import Credentials
from transport.kit import unpack_kit

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NAMES = [f"dev-{i}" for i in range(4)]
VICTIM = "dev-0"


def _federation(tmp: Path, fb: Any) -> Path:
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="flayer", rounds=1, dataset="digits", seed=0, lr=0.05, quorum=len(NAMES),
                          min_devices=len(NAMES), deadline_s=120.0)
    fed.write_text(fed.read_text() + '[privacy]\nsecure_aggregation = true\nsecure_stage_s = 10.0\nenabled = true\n'
                                     'mode = "local"\nclip = 0.5\nnoise_multiplier = 1.0\npopulation = 40\n')
    return fed


def _devices(tmp: Path, fb: Any, digits: Any) -> list[EdgeClient]:
    part = make_partition(digits.y, digits.num_classes, len(NAMES), "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp / "digits.npz")
    out = []
    for i, name in enumerate(NAMES):  # each device runs from its kit (its certificate, the pinned authority key)
        kit = unpack_kit(write_kit(fb.state_dir, name, tmp / f"machine-{name}" / f"{name}.tar.gz")).parent
        path = device_toml(tmp / f"{name}.toml", kit / "credentials.toml", dataset="digits", partition_file=pfile,
                           client=i, state_dir=tmp / name)
        creds = Credentials.load(kit / "credentials.toml")
        out.append(EdgeClient(load_device_config(path).edge, creds, client_data(digits, part.clients[i])))
    for dev in out:
        dev.start()
    for dev in out:
        assert dev.link.connected.wait(60)
    return out


def _lying_coordinator(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The coordinator shows the victim the survivor set without it and keeps the victim's signature over that set
    (its own bookkeeping, checked by nobody); every other device is shown the set the masked inputs make."""
    shown: list[str] = []
    real_request, real_signature = SecAggServer.consistency_request, SecAggServer.receive_signature

    def consistency_request(self: SecAggServer, device: str) -> Any:
        req = real_request(self, device)
        if device != VICTIM or VICTIM not in req.survivors:
            return req
        shown.append(device)
        return dataclasses.replace(req, survivors=tuple(d for d in req.survivors if d != VICTIM))

    def receive_signature(self: SecAggServer, msg: SurvivorSignature) -> None:
        if msg.device == VICTIM and shown:
            self._signatures[msg.device] = msg.signature
            return
        real_signature(self, msg)

    monkeypatch.setattr(SecAggServer, "consistency_request", consistency_request)
    monkeypatch.setattr(SecAggServer, "receive_signature", receive_signature)
    return shown


@pytest.mark.timeout(400)
def test_a_set_without_the_victim_after_its_masked_input_keeps_its_booking(
        tmp_path: Path, digits: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shown = _lying_coordinator(monkeypatch)
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", NAMES)
    devices: list[EdgeClient] = []
    try:
        devices = _devices(tmp_path, fb, digits)
        coord = Coordinator(load_coordinator_config(_federation(tmp_path, fb)), fb.coordinator)
        thread = coord.start()
        finished(coord, thread, 300, rounds=1)
        assert shown == [VICTIM], f"the victim was never shown a set without itself: {shown}"
        rec = next(r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round")
        assert rec["secure_abandoned"] is None, f"the round was not unmasked: {rec['secure_abandoned']}"
        assert VICTIM in rec["secure_survivors"], "the revealed sum did not hold the victim's input"
        victim = next(d for d in devices if d.id == VICTIM)
        booked = DeviceLedger.from_extra(victim.stored.extra).rounds
        assert booked == 1, (f"the victim's ledger counts {booked} rounds while a revealed sum held its input "
                             "(its booking was taken back when it signed a set without itself)")
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()
