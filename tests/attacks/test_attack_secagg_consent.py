"""A coordinator cannot reveal a device's input in a sum without the device booking it first
(docs/explanation/secure-aggregation.md, "The consent stage"; docs/explanation/guarantees.md).

The adversary is the coordinator: its own credentials, the messages it signs to each device, what it does with
what the devices send it. A private secure round (distributed DP, every device's ledger counting it) runs over a
real Mosquitto with real edge clients, each from its kit. The coordinator collects the masked inputs of round 1,
asks the victim neither for its consent nor to unmask, keeps the victim in the survivor set anyway (its masked input
in the sum), asks the victim's neighbours for their shares of the victim's self-mask seed b_u, and names round 1
void in round 2's plan. On the code before (a provisional booking at the masked input, final at the unmask answer,
taken back when a later plan names the round void) the victim's ledger missed round 1 while the sum revealed for it
held the victim's input. Now the neighbours refuse to reveal a share of b_u without the victim's consent, which the
victim gives only after it booked the round: every revealed sum that held the victim's input is in its ledger.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from fedtestlib import device_toml, federation_toml, finished, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.secure_phase import SecurePhase
from coordinator.secure_round import SecureRound
from coordinator.server import Coordinator
from edge_client.budget import DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.partition import make_partition, save_partition
from flayer.secagg import decode_message
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from mqtt_broker.kit import write_kit
from protocol.metrics_schema import read_metrics
from transport.credentials import Credentials
from transport.kit import unpack_kit

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NAMES = [f"dev-{i}" for i in range(4)]
VICTIM = "dev-0"
WITHHELD = ("ConsentRequest", "UnmaskRequest")  # what the coordinator never sends the victim in round 1


def _federation(tmp: Path, fb: Any) -> Path:
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="flayer", rounds=2, dataset="digits", seed=0, lr=0.05, quorum=len(NAMES),
                          min_devices=len(NAMES), deadline_s=120.0)
    fed.write_text(fed.read_text() + '[privacy]\nsecure_aggregation = true\nsecure_stage_s = 6.0\nenabled = true\n'
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
        out.append(EdgeClient(load_device_config(path).edge, Credentials.load(kit / "credentials.toml"),
                              client_data(digits, part.clients[i])))
    for dev in out:
        dev.start()
    for dev in out:
        assert dev.link.connected.wait(60)
    return out


def _lying_coordinator(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Round 1: nothing of the consent or unmask stage reaches the victim, yet the victim stays a survivor (its masked
    input in the sum; its neighbours asked for their shares of b_victim); round 2's plan names round 1 void."""
    lie: dict[str, Any] = {"withheld": [], "session": None}
    real_advance, real_plan = SecureRound.advance, SecurePhase.plan

    def advance(self: SecureRound, now: float, masked_done: bool = False) -> list[tuple[str, bytes]]:
        out = real_advance(self, now, masked_done)
        if self.planned.params.round != 1:
            return out
        lie["session"] = self.planned.params.session
        kept = []
        for device, body in out:
            kind = type(decode_message(body)).__name__
            if device == VICTIM and kind in WITHHELD:
                lie["withheld"].append(kind)
            else:
                kept.append((device, body))
        return kept

    def plan(self: SecurePhase, rnd: Any) -> dict[str, Any]:
        out = real_plan(self, rnd)
        if out and rnd is not None and rnd.number == 2 and lie["session"]:
            out["void"] = f"{out.get('void', '')} {lie['session']}".strip()
        return out

    monkeypatch.setattr(SecureRound, "advance", advance)
    monkeypatch.setattr(SecurePhase, "plan", plan)
    try:  # the consent stage, where it exists: the victim counted as consenting, no consent of its to forward
        from flayer.secagg.server_consent import ConsentBook
    except ImportError:
        return lie

    def close(self: ConsentBook, masked: frozenset[str], total: Any) -> frozenset[str]:
        self.sent = masked
        return masked  # every masked input stays in the sum, the victim's too

    def signatures(self: ConsentBook, devices: Any) -> tuple[tuple[str, bytes], ...]:
        return tuple((d, self._consents[d]) for d in devices if d in self._consents)

    monkeypatch.setattr(ConsentBook, "close", close)
    monkeypatch.setattr(ConsentBook, "signatures", signatures)
    return lie


@pytest.mark.timeout(500)
def test_a_sum_holding_the_victims_input_is_never_revealed_without_the_victim_booking_it(
        tmp_path: Path, digits: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lie = _lying_coordinator(monkeypatch)
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", NAMES)
    devices: list[EdgeClient] = []
    try:
        devices = _devices(tmp_path, fb, digits)
        coord = Coordinator(load_coordinator_config(_federation(tmp_path, fb)), fb.coordinator)
        thread = coord.start()
        finished(coord, thread, 400, rounds=2)
        assert "UnmaskRequest" in lie["withheld"] or "ConsentRequest" in lie["withheld"], lie
        records = {r["round"]: r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"}
        assert sorted(records) == [1, 2]
        first = records[1]
        assert VICTIM in first["secure_survivors"], "the lying coordinator did not keep the victim in the sum"
        revealed = [r for r, rec in sorted(records.items())
                    if rec["secure_abandoned"] is None and VICTIM in rec["secure_survivors"]]
        victim = next(d for d in devices if d.id == VICTIM)
        booked = DeviceLedger.from_extra(victim.stored.extra).rounds
        assert booked >= len(revealed), (f"sums holding the victim's input were revealed in rounds {revealed}, but its "
                                         f"ledger counts {booked} round(s)")
        if 1 not in revealed:  # the neighbours refused: no share of b_victim without the victim's consent
            assert "b_dev-0" in (first["secure_abandoned"] or ""), first["secure_abandoned"]
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()
