"""Sealed shares signed by their sender: a share that does not authenticate can be proved the sender's fault.

Whoever routes a sealed share can alter it, so a share that does not authenticate proved nothing of its sender,
and its receiver could not complain of it: the key a complaint reveals would open what the sender really sealed
(:mod:`.server_complaints`). So a device that sealed its neighbours shares that do not authenticate was never
named, and lost the round every time it was selected. Now, in a round with long-term keys, the sender signs each
sealed share (:func:`share_message`: the round's plan digest, session, round, both ids, the two channel keys of the
pair it sealed under -- its own toward the receiver and the receiver's toward it, as its bundle gave it -- and the
ciphertext). The receiver checks that signature against the federation's registry before anything else:

* it does not verify: the router altered the share (or replayed one): held as nothing, no complaint, as before;
* it verifies and the share does not authenticate, or holds no share at the receiver's x: only the sender can have
  sealed it, under the pair's key and associated data the signature names, so the receiver complains with the
  pair's channel key -- which opens this ciphertext (the sender's own garbage) and the receiver's shares held by the
  sender, nothing else -- and the coordinator, which routed the signed ciphertext, opens it and names the sender.

The coordinator checks every signature when the batch arrives (:func:`batch_problem`): a batch whose signatures do
not verify came in the sender's own envelope, so the sender is named and its batch refused. Cost: 64 bytes a
sealed share, sent and received (k of each per device), k signatures and k verifications per device.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

from ._wire import pack_id
from .consistency import SIGNATURE_LEN, Sign, Verify
from .keys import check_session
from .msg_setup import EncryptedShare, ShareBatch
from .params import SecAggParams

__all__ = ["SHARE_DOMAIN", "batch_problem", "share_message", "share_signed", "sign_share"]

SHARE_DOMAIN = b"flayer-secagg/v1/sealed-share\x00"
_U32 = struct.Struct("<I")


def share_message(params: SecAggParams, sender: str, receiver: str, sender_pk: bytes, receiver_pk: bytes,
                  ciphertext: bytes) -> bytes:
    """The bytes ``sender`` signs for the share it sealed to ``receiver`` under the pair (sender_pk, receiver_pk)."""
    raw = check_session(params.session).encode()
    return (SHARE_DOMAIN + bytes([len(raw)]) + raw + _U32.pack(params.round) + params.transcript + pack_id(sender)
            + pack_id(receiver) + bytes(sender_pk) + bytes(receiver_pk) + bytes(ciphertext))


def sign_share(params: SecAggParams, share: EncryptedShare, sender_pk: bytes, receiver_pk: bytes,
               sign: Sign) -> EncryptedShare:
    """``share`` with its sender's signature."""
    message = share_message(params, share.sender, share.receiver, sender_pk, receiver_pk, share.ciphertext)
    return dataclasses.replace(share, signature=bytes(sign(message)))


def share_signed(params: SecAggParams, share: EncryptedShare, sender_pk: bytes, receiver_pk: bytes,
                 verify: Verify) -> bool:
    """Whether ``share`` carries its sender's signature over exactly this pair and ciphertext (``verify``: the
    federation's registry, never keys the coordinator supplies)."""
    if len(share.signature) != SIGNATURE_LEN:
        return False
    message = share_message(params, share.sender, share.receiver, sender_pk, receiver_pk, share.ciphertext)
    return verify(share.sender, message, share.signature)


def batch_problem(params: SecAggParams, batch: ShareBatch, pair_key: Callable[[str, str], bytes],
                  verify: Verify) -> str | None:
    """Why the coordinator refuses a sender's batch (a share its sender did not sign), or None; ``pair_key(owner,
    toward)``: the channel key ``owner`` advertised toward ``toward``."""
    for share in batch.shares:
        if not share_signed(params, share, pair_key(share.sender, share.receiver),
                            pair_key(share.receiver, share.sender), verify):
            return (f"share batch of {share.sender}: its share for {share.receiver} is not signed by "
                    f"{share.sender}'s registry key")
    return None
