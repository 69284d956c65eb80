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
from pathlib import Path
from typing import Any

import pytest
from attacklib_secagg import kit_fleet, private_secure_rounds

from edge_client.budget import DeviceLedger
from flayer.secagg import SecAggServer, SurvivorSignature

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NAMES = [f"dev-{i}" for i in range(4)]
VICTIM = "dev-0"


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
    with kit_fleet(tmp_path, digits, NAMES) as (fb, devices):
        rec = private_secure_rounds(tmp_path, fb, len(NAMES), rounds=1, stage_s=10.0, timeout=300)[0]
        assert shown == [VICTIM], f"the victim was never shown a set without itself: {shown}"
        assert rec["secure_abandoned"] is None, f"the round was not unmasked: {rec['secure_abandoned']}"
        assert VICTIM in rec["secure_survivors"], "the revealed sum did not hold the victim's input"
        victim = next(d for d in devices if d.id == VICTIM)
        booked = DeviceLedger.from_extra(victim.stored.extra).rounds
        assert booked == 1, (f"the victim's ledger counts {booked} rounds while a revealed sum held its input "
                             "(its booking was taken back when it signed a set without itself)")
