"""Signed key adverts (Bonawitz et al., CCS 2017, the active-adversary variant): the coordinator relays keys it
cannot change.

Without signatures a coordinator that relays the key bundles can put its own keys in place of a neighbour's: a
device then seals that neighbour's shares under a channel key the coordinator holds (and masks with a mask key it
holds) and the coordinator reads every share -- a man in the middle. So each device signs, with its **long-term
device key** (certified by the federation's authority, :mod:`edge_client.certified_keys`; in process
:class:`~.consistency.LocalIdentities`),
what each neighbour v will receive of its advert (:func:`advert_message`): the session, the round, the sender, the
receiver v, the sender's channel key toward v, its mask key s_pk, its commitment to b_u and the round's plan digest
(:attr:`~.params.SecAggParams.transcript`: a device shown another plan verifies none of it). One 64-byte signature
per neighbour rides in the advert, in the order of the sorted neighbours (the order of its channel keys); the
coordinator checks each against the registry when the advert arrives (:class:`SignedAdvertStage`: a bad one refuses
the advert, as if it never came) and relays, in each bundle entry, the owner's one signature toward that bundle's
receiver. A device checks every entry of its bundle against **the owner's certified key** before it seals a share
or masks (:func:`bundle_problem`); one that does not verify -- or a neighbour with no valid certificate -- means the
coordinator (or whoever wrote the bundle) lied, and the device refuses the round.

Why per-neighbour signatures: a bundle entry then carries 64 B of signature; one signature over the whole advert
would make each entry carry the owner's k channel keys as well (32 k B an entry, about 1.2 KB at k = 38), and a
Merkle path over them 32 log2(k) B (192 B at k = 38) plus the root; per-neighbour signing costs the sender k
signatures (tens of microseconds each) and 64 k B more in its advert.

The signatures are separate from every other signed message: the bytes start with :data:`ADVERT_DOMAIN` (the survivor
set's start with its own), and on a real device the signer binds the federation, the round, the device and the
purpose ``secagg:advert`` besides (:func:`protocol.signing.advert_signer`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
from collections.abc import Iterator

from . import keys
from ._wire import pack_id
from .consistency import SIGNATURE_LEN, AdmitCert, DeviceConsistency, ServerConsistency, Sign, Verify
from .errors import SecAggError
from .keys import check_session
from .msg_setup import KeyAdvert, KeyBundle
from .params import SecAggParams

__all__ = ["ADVERT_DOMAIN", "AdvertSignatureError", "SignedAdvertStage", "advert_message", "bundle_problem",
           "device_signs", "sign_advert"]

log = logging.getLogger(__name__)
ADVERT_DOMAIN = b"flayer-secagg/v1/key-advert\x00"
_U32 = struct.Struct("<I")


class AdvertSignatureError(SecAggError):
    """An advert's signatures do not verify under its sender's registry key (or are not one per neighbour)."""


def advert_message(session: str, round_id: int, sender: str, receiver: str, channel_pk: bytes, s_pk: bytes,
                   b_commit: bytes, transcript: bytes, cert: bytes = b"") -> bytes:
    """The bytes ``sender`` signs for ``receiver``: domain, session, round, both ids, the three keys it relays, the
    plan digest it acted on (:attr:`~flayer.secagg.params.SecAggParams.transcript`: the cohort, k, t, ...) and,
    when the advert carries the sender's certificate, its SHA-256 (the certificate is bound by the signature)."""
    raw = check_session(session).encode()
    return (ADVERT_DOMAIN + bytes([len(raw)]) + raw + _U32.pack(round_id) + pack_id(sender) + pack_id(receiver)
            + channel_pk + s_pk + b_commit + bytes(transcript) + (hashlib.sha256(cert).digest() if cert else b""))


def _entries(params: SecAggParams, advert: KeyAdvert) -> Iterator[tuple[str, bytes]]:
    """(receiver, the advert's channel key toward it) for each neighbour of the sender, sorted (the signatures' order):
    ``c_pk`` toward the first, ``pair_pks`` toward the others (or ``c_pk`` toward all without per-pair keys)."""
    for i, v in enumerate(sorted(params.neighbours(advert.device))):
        yield v, (advert.c_pk if i == 0 or not advert.pair_pks else advert.pair_pks[i - 1])


def sign_advert(params: SecAggParams, advert: KeyAdvert, sign: Sign) -> KeyAdvert:
    """``advert`` with its sender's signature toward each neighbour."""
    p = params
    sigs = tuple(bytes(sign(advert_message(p.session, p.round, advert.device, v, key, advert.s_pk, advert.b_commit,
                                               p.transcript, advert.cert)))
                 for v, key in _entries(p, advert))
    return dataclasses.replace(advert, signatures=sigs)


def bundle_problem(params: SecAggParams, device: str, bundle: KeyBundle, verify: Verify,
                   admit: AdmitCert | None = None) -> str | None:
    """Why ``device`` must refuse ``bundle`` (an entry whose certificate ``admit`` refuses, or not signed by its
    owner's key toward this device), or None. ``verify`` holds the keys of the certificates ``admit`` accepted (or the
    federation's registry): never keys the coordinator supplies unchecked."""
    p = params
    for a in bundle.adverts:
        why = admit(a.device, a.cert) if admit is not None else None
        if why is not None:
            return (f"the key bundle's entry for {a.device} carries no valid certificate of {a.device} ({why}): the "
                    "coordinator checks each advert's certificate against the same authority and revocation list "
                    "when it arrives, so it lied (or holds an older list than this device); this device refuses the "
                    "round")
        if len(a.signatures) != 1 or len(a.signatures[0]) != SIGNATURE_LEN:
            return (f"the key bundle's entry for {a.device} carries no signature of {a.device}: the coordinator "
                    "relays keys their owner did not sign (it could read the shares sealed under them)")
        message = advert_message(p.session, p.round, a.device, device, a.c_pk, a.s_pk, a.b_commit, p.transcript,
                                 a.cert)
        if not verify(a.device, message, a.signatures[0]):
            return (f"the key bundle's entry for {a.device} is not signed by {a.device}'s key as this device knows it "
                    "(its certificate from the federation's authority; keys swapped, or a signature replayed from "
                    "another round, session or receiver): the coordinator lied -- or no valid certificate of "
                    f"{a.device} has reached this device (never certified, revoked, or not yet arrived); this device "
                    "refuses the round")
    return None


class SignedAdvertStage:
    """The coordinator's side (mixed into :class:`~.server.SecAggServer`): check the signatures of an advert, relay
    the owner's signature toward each receiver."""

    params: SecAggParams
    consistency: ServerConsistency | None
    faulty: dict[str, str]
    _adverts: dict[str, KeyAdvert]

    def _pair_key(self, owner: str, toward: str) -> bytes:
        raise NotImplementedError

    def _pair_keys_problem(self, advert: KeyAdvert) -> str | None:  # server_complaints.ComplaintStage
        raise NotImplementedError

    @property
    def advert_verify(self) -> Verify | None:
        """The registry the adverts' signatures are checked against (None: relayed unchecked, the devices check)."""
        c = self.consistency
        if c is None:
            return None
        return c.verify_advert if c.verify_advert is not None else c.verify

    def _bad_keys(self, advert: KeyAdvert) -> str | None:
        """Why an advert's keys are refused (its sender proven faulty: anyone can check it), or None."""
        if advert.c_pk == advert.s_pk or advert.s_pk in advert.pair_pks:
            return f"{advert.device} advertised one key for both purposes"
        why = self._pair_keys_problem(advert)
        if why is not None:
            return why
        if len({advert.c_pk, *advert.pair_pks}) != 1 + len(advert.pair_pks):
            return f"{advert.device} advertised one channel key for two neighbours"
        for key, what in ((advert.c_pk, "c_pk"), (advert.s_pk, "s_pk"),
                          *((k, f"pair key {i}") for i, k in enumerate(advert.pair_pks))):
            try:
                keys.check_public_key(key, f"{advert.device}'s {what}")
            except SecAggError as exc:
                return str(exc)
        taken = {k: d for d, a in self._adverts.items() for k in (a.c_pk, a.s_pk, *a.pair_pks)}
        for key in (advert.c_pk, advert.s_pk, *advert.pair_pks):
            if key in taken:
                return f"{advert.device} advertised a public key {taken[key]} advertised first"
        return None

    def _signature_problem(self, advert: KeyAdvert) -> None:
        """AdvertSignatureError when the advert's signatures are not one per neighbour or do not verify; SecAggError
        when it is unsigned and the round checks signatures. The advert is then refused, its sender not named here:
        who sent a message is the transport's to say (:meth:`name_faulty`)."""
        p, verify = self.params, self.advert_verify
        if advert.device in self.faulty:  # e.g. a false signature first, a good one after: the first one stands
            raise SecAggError(f"key advert from {advert.device}, named faulty: {self.faulty[advert.device]}")
        near = len(p.neighbours(advert.device))
        if advert.signatures and len(advert.signatures) != near:
            raise AdvertSignatureError(f"key advert of {advert.device} carries {len(advert.signatures)} signatures, "
                                       f"not one per neighbour ({near})")
        if len(advert.pair_pks) != near - 1:
            return  # no key for some signature: refused, its sender named, as malformed pair keys (_bad_keys)
        admit = self.consistency.admit_cert if self.consistency is not None else None
        why = admit(advert.device, advert.cert) if admit is not None else None
        if why is not None:
            raise AdvertSignatureError(f"key advert of {advert.device}: {why}; refused, as if it never came")
        if verify is None:
            return
        if not advert.signatures:
            raise SecAggError(f"key advert of {advert.device} is unsigned: this round's adverts carry their owner's "
                              "signature toward each neighbour")
        for (v, key), sig in zip(_entries(p, advert), advert.signatures, strict=True):
            if not verify(advert.device, advert_message(p.session, p.round, advert.device, v, key, advert.s_pk,
                                                        advert.b_commit, p.transcript, advert.cert), sig):
                raise AdvertSignatureError(f"key advert of {advert.device}: its signature toward {v} does not verify "
                                           f"under {advert.device}'s registry key; refused, as if it never came")

    def name_faulty(self, device: str, why: str) -> None:
        """Name ``device`` faulty for a message the transport proved it sent (the coordinator: its envelope verified
        under the device's own key and named it)."""
        if device not in self.faulty:
            self.faulty[device] = why
            log.warning("secagg round %d: %s named faulty: %s", self.params.round, device, why)

    def _bundle_entry(self, owner: str, receiver: str) -> KeyAdvert:
        """What ``receiver`` gets of ``owner``'s advert: its channel key toward it, s_pk, b_commit and the owner's
        signature toward it (if the advert was signed)."""
        a = self._adverts[owner]
        sig = a.signatures[sorted(self.params.neighbours(owner)).index(receiver)] if a.signatures else None
        return dataclasses.replace(a, c_pk=self._pair_key(owner, receiver), pair_pks=(),
                                   signatures=(sig,) if sig is not None else ())


def device_signs(consistency: DeviceConsistency | None) -> tuple[Sign, Verify] | None:
    """A device's advert signer and the registry it checks bundles against (None: unsigned adverts, unchecked)."""
    if consistency is None:
        return None
    return (consistency.sign_advert or consistency.sign, consistency.verify_advert or consistency.verify)
