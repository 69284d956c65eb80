"""The consent stage's messages and the bytes a device signs to consent (docs/explanation/secure-aggregation.md).

Between the masked inputs and the consistency round, the coordinator asks each device whose masked input it holds
for its consent (:class:`ConsentRequest`: the header and the device's id, nothing else); the device books the round
in its privacy ledger, then answers with its Ed25519 signature by its long-term key over :func:`consent_message`
(:class:`Consent`). The unmask request sent to a neighbour v carries the consent of every survivor it lists
(:attr:`~flayer.secagg.msg_unmask.UnmaskRequest.consents`), and v reveals its share of b_u only when u's consent
verifies under u's key: u's input can enter a revealed sum only after u booked it.

Layout (the header of :mod:`.messages`, then the body):

=================  ===================  ==========================================================
kind               direction            body
=================  ===================  ==========================================================
10 ConsentRequest  server -> device     id                                          1 + |id| B
11 Consent         device -> server     id, 64 B signature                          65 + |id| B
=================  ===================  ==========================================================
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ._wire import check_bytes, check_id, check_round, header, open_message, pack_id
from .consistency import SIGNATURE_LEN
from .keys import check_session

__all__ = ["Consent", "ConsentRequest", "consent_message"]

_DOMAIN = b"flayer-secagg/v1/consent\x00"
_U32 = struct.Struct("<I")


def consent_message(session: str, round_id: int, device: str, transcript: bytes) -> bytes:
    """The bytes ``device`` signs to consent to its masked input of (``session``, ``round_id``) entering the round's
    revealed sum: the domain, the session, the round, the device and the plan digest it acted on
    (:attr:`~flayer.secagg.params.SecAggParams.transcript`, as :func:`~flayer.secagg.consistency.survivor_set_message`
    binds it): a consent given under another plan, round, session or by another device counts for nobody here."""
    session_raw = check_session(session).encode()
    device_raw = check_id(device, "consenting device").encode("ascii")
    return (_DOMAIN + bytes([len(session_raw)]) + session_raw + _U32.pack(round_id) + bytes([len(device_raw)])
            + device_raw + bytes(transcript))


@dataclass(frozen=True)
class ConsentRequest:
    """Consent stage, server -> device: asks ``device`` to consent to its masked input of ``round`` being summed."""

    round: int
    device: str

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "ConsentRequest device")

    def to_bytes(self) -> bytes:
        return header(10, self.round) + pack_id(self.device)

    @classmethod
    def from_bytes(cls, data: bytes) -> ConsentRequest:
        r, round_id = open_message(data, 10, "ConsentRequest")
        device = r.device("device")
        r.done()
        return cls(round_id, device)


@dataclass(frozen=True)
class Consent:
    """Consent stage, device -> server: its signature over :func:`consent_message` (64 B)."""

    round: int
    device: str
    signature: bytes = field(repr=False)

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "Consent device")
        check_bytes(self.signature, SIGNATURE_LEN, "Consent signature")

    def to_bytes(self) -> bytes:
        return header(11, self.round) + pack_id(self.device) + self.signature

    @classmethod
    def from_bytes(cls, data: bytes) -> Consent:
        r, round_id = open_message(data, 11, "Consent")
        device = r.device("device")
        sig = r.take(SIGNATURE_LEN, "signature")
        r.done()
        return cls(round_id, device, sig)
