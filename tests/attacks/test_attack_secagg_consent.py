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

from pathlib import Path
from typing import Any

import pytest
from attacklib_secagg import kit_fleet, private_secure_rounds

from coordinator.secure_phase import SecurePhase
from coordinator.secure_round import SecureRound
from edge_client.budget import DeviceLedger
from flayer.secagg import decode_message

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NAMES = [f"dev-{i}" for i in range(4)]
VICTIM = "dev-0"
WITHHELD = ("ConsentRequest", "UnmaskRequest")  # what the coordinator never sends the victim in round 1


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
    with kit_fleet(tmp_path, digits, NAMES) as (fb, devices):
        run = private_secure_rounds(tmp_path, fb, len(NAMES), rounds=2, stage_s=6.0, timeout=400)
        assert "UnmaskRequest" in lie["withheld"] or "ConsentRequest" in lie["withheld"], lie
        records = {r["round"]: r for r in run}
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
