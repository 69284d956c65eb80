"""The messages of the four secure-aggregation stages and their compact binary layout.

Every message is ``header || body``; the header is ``b"FLSA"``, version (u8, 1), kind (u8) and round
(u32), all little-endian. Ids are u8 length + ASCII (the project's 1-64 character device ids), lists
are u16 count + entries (at most 1025: a device's k <= 1024 neighbours and itself). The adverts' signatures
(:mod:`.signed_adverts`) are a u16 count and 64 B each: k in an advert, at most one in a bundle entry, none in a
round without long-term keys. ``from_bytes``
validates every length, count and id before it allocates and names the field that was wrong
(:class:`~flayer.secagg.errors.SecAggError`, a ``ValueError``). Sizes (k neighbours, n coordinates):

=================  ===================  ==========================================================
kind               direction            body
=================  ===================  ==========================================================
1 KeyAdvert        device -> server     id, c_pk, s_pk, b_commit, k - 1 pair keys,   ~ 130 + 96 k B
                                        k signatures (u16 count, 64 B each),
                                        certificate (u16 length, ~283 B or 0)
2 KeyBundle        server -> device     receiver id, count, (id, c_pk, s_pk,        ~ 455 k B
                                        b_commit, 1 signature, certificate) each
3 ShareBatch       both ways            id, count, u8 signed, (sender, receiver,    ~ 264 k B
                                        164 B sealed, 64 B sender's signature) each
4 MaskedInput      device -> server     id, u8 width w, u32 n, n values of w bits   n w / 8 B
5 UnmaskRequest    server -> device     id, u32 survivor count, survivors, dropped, ~ 20 k B
                                        signatures, their signers' certificates,    + 355 (T - 1) B
                                        the listed survivors' consents              + ~ 75 k B
6 UnmaskShares     device -> server     id, b shares (id, 68 B), s shares (id, 68 B) ~ 90 k B
10 ConsentRequest  server -> device     id (:mod:`.msg_consent`)                    ~ 20 B
11 Consent         device -> server     id, 64 B signature                          ~ 85 B
=================  ===================  ==========================================================
"""

from __future__ import annotations

from ._wire import MAGIC, VERSION
from .errors import SecAggError
from .msg_consent import Consent, ConsentRequest
from .msg_setup import CIPHERTEXT_LEN, EncryptedShare, KeyAdvert, KeyBundle, ShareBatch, ShareComplaint
from .msg_unmask import ConsistencyRequest, MaskedInput, SurvivorSignature, UnmaskRequest, UnmaskShares

__all__ = [
    "CIPHERTEXT_LEN",
    "MAGIC",
    "VERSION",
    "Consent",
    "ConsentRequest",
    "ConsistencyRequest",
    "EncryptedShare",
    "KeyAdvert",
    "KeyBundle",
    "MaskedInput",
    "Message",
    "ShareBatch",
    "ShareComplaint",
    "SurvivorSignature",
    "UnmaskRequest",
    "UnmaskShares",
    "decode_message",
]

Message = (KeyAdvert | KeyBundle | ShareBatch | MaskedInput | UnmaskRequest | UnmaskShares | ConsistencyRequest
           | SurvivorSignature | ShareComplaint | ConsentRequest | Consent)
_KINDS: dict[int, type[Message]] = {1: KeyAdvert, 2: KeyBundle, 3: ShareBatch, 4: MaskedInput,
                                    5: UnmaskRequest, 6: UnmaskShares, 7: ConsistencyRequest, 8: SurvivorSignature,
                                    9: ShareComplaint, 10: ConsentRequest, 11: Consent}


def decode_message(data: bytes) -> Message:
    """Any stage's message from its bytes (dispatch on the header's kind)."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < 10:
        raise SecAggError("secagg message: shorter than its header")
    kind = bytes(data[5:6])[0]
    if kind not in _KINDS:
        raise SecAggError(f"secagg message: unknown kind {kind}")
    return _KINDS[kind].from_bytes(bytes(data))
