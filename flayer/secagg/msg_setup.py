"""Stage 1 and 2 messages: key adverts, key bundles and sealed shares (layout: :mod:`.messages`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._wire import (
    MAX_ENTRIES,
    Reader,
    check_bytes,
    check_id,
    check_list,
    check_round,
    header,
    open_message,
    pack_id,
    pack_u16,
)
from .consistency import SIGNATURE_LEN
from .errors import SecAggError
from .keys import COMMIT_LEN, KEY_LEN, NONCE_LEN, TAG_LEN
from .shamir import SHARE_LEN

__all__ = ["CIPHERTEXT_LEN", "MAX_CERT_LEN", "EncryptedShare", "KeyAdvert", "KeyBundle", "ShareBatch", "ShareComplaint"]

CIPHERTEXT_LEN = NONCE_LEN + 2 * SHARE_LEN + TAG_LEN  # nonce, share of b_u and of s_u, tag
MAX_CERT_LEN = 4096  # a device certificate (protocol.certs.MAX_CERT_BYTES; about 280 B)


@dataclass(frozen=True)
class KeyAdvert:
    """Stage 1, device -> server: the device's two public keys of this round and its commitment to its
    self-mask seed b_u (:func:`~flayer.secagg.keys.commit_seed`: the rebuilt b_u is checked against it).

    ``pair_pks``: with per-pair channel keys (what a verifiable complaint needs), ``c_pk`` is the key toward the
    device's first neighbour (sorted) and ``pair_pks`` those toward the others, in order; in a key bundle the
    coordinator puts in ``c_pk`` the sender's key toward the bundle's receiver and leaves ``pair_pks`` empty.

    ``signatures``: the sender's long-term signature toward each neighbour, sorted (:mod:`.signed_adverts`); in a key
    bundle the one toward the bundle's receiver; empty in a round without long-term keys.

    ``cert``: the sender's certificate from the federation's authority (:mod:`protocol.certs` text, about 280 B),
    bound by each signature (:func:`~.signed_adverts.advert_message`) and relayed in each bundle entry, so every
    receiver checks the key against the authority itself; empty where devices' keys come from a registry."""

    round: int
    device: str
    c_pk: bytes
    s_pk: bytes
    b_commit: bytes = bytes(COMMIT_LEN)
    pair_pks: tuple[bytes, ...] = ()
    signatures: tuple[bytes, ...] = field(default=(), repr=False)
    cert: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "KeyAdvert device")
        if not isinstance(self.cert, bytes) or len(self.cert) > MAX_CERT_LEN:
            raise SecAggError(f"KeyAdvert cert: bytes of at most {MAX_CERT_LEN}")
        check_bytes(self.c_pk, KEY_LEN, "KeyAdvert c_pk")
        check_bytes(self.s_pk, KEY_LEN, "KeyAdvert s_pk")
        check_bytes(self.b_commit, COMMIT_LEN, "KeyAdvert b_commit")
        object.__setattr__(self, "pair_pks", tuple(self.pair_pks))
        if len(self.pair_pks) > MAX_ENTRIES:
            raise SecAggError(f"KeyAdvert: {len(self.pair_pks)} pair keys exceed the limit {MAX_ENTRIES}")
        for key in self.pair_pks:
            check_bytes(key, KEY_LEN, "KeyAdvert pair key")
        object.__setattr__(self, "signatures", tuple(self.signatures))
        if len(self.signatures) > MAX_ENTRIES:
            raise SecAggError(f"KeyAdvert: {len(self.signatures)} signatures exceed the limit {MAX_ENTRIES}")
        for sig in self.signatures:
            check_bytes(sig, SIGNATURE_LEN, "KeyAdvert signature")

    def _body(self) -> bytes:
        return (pack_id(self.device) + self.c_pk + self.s_pk + self.b_commit
                + pack_u16(len(self.pair_pks), "pair keys") + b"".join(self.pair_pks)
                + pack_u16(len(self.signatures), "signatures") + b"".join(self.signatures)
                + pack_u16(len(self.cert), "cert") + self.cert)

    def to_bytes(self) -> bytes:
        return header(1, self.round) + self._body()

    @classmethod
    def _read(cls, r: Reader, round_id: int, what: str) -> KeyAdvert:
        device = r.device(f"{what} device")
        c_pk, s_pk = r.take(KEY_LEN, f"{what} c_pk"), r.take(KEY_LEN, f"{what} s_pk")
        commit = r.take(COMMIT_LEN, f"{what} b_commit")
        pairs = tuple(r.take(KEY_LEN, f"{what} pair key {i}") for i in range(r.count(f"{what} pair keys", MAX_ENTRIES)))
        sigs = tuple(r.take(SIGNATURE_LEN, f"{what} signature {i}")
                     for i in range(r.count(f"{what} signatures", MAX_ENTRIES)))
        cert = r.take(r.count(f"{what} cert length", MAX_CERT_LEN), f"{what} cert")
        return cls(round_id, device, c_pk, s_pk, commit, pairs, sigs, cert)

    @classmethod
    def from_bytes(cls, data: bytes) -> KeyAdvert:
        r, round_id = open_message(data, 1, "KeyAdvert")
        out = cls._read(r, round_id, "KeyAdvert")
        r.done()
        return out


@dataclass(frozen=True)
class KeyBundle:
    """Stage 1, server -> device: the adverts of the device's neighbours that advertised (each with at most one
    signature: its owner's toward this bundle's device, :mod:`.signed_adverts`)."""

    round: int
    device: str
    adverts: tuple[KeyAdvert, ...]

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "KeyBundle device")
        object.__setattr__(self, "adverts", tuple(self.adverts))
        if not all(isinstance(a, KeyAdvert) and a.round == self.round for a in self.adverts):
            raise SecAggError("KeyBundle adverts must be KeyAdverts of the bundle's round")
        if any(len(a.signatures) > 1 for a in self.adverts):
            raise SecAggError("KeyBundle: an entry carries more than its owner's one signature toward the receiver")
        check_list(tuple(a.device for a in self.adverts), "KeyBundle adverts")

    def to_bytes(self) -> bytes:
        body = b"".join(a._body() for a in self.adverts)
        return (header(2, self.round) + pack_id(self.device)
                + pack_u16(len(self.adverts), "KeyBundle count") + body)

    @classmethod
    def from_bytes(cls, data: bytes) -> KeyBundle:
        r, round_id = open_message(data, 2, "KeyBundle")
        device = r.device("device")
        count = r.count("advert count", MAX_ENTRIES)
        adverts = tuple(KeyAdvert._read(r, round_id, f"advert {i}") for i in range(count))
        r.done()
        return cls(round_id, device, adverts)


@dataclass(frozen=True)
class EncryptedShare:
    """One sealed pair (share of b_sender, share of s_sender) for one receiver (:mod:`.keys`); ``signature``: the
    sender's long-term signature over it (:mod:`.signed_shares`; empty in a round without long-term keys)."""

    sender: str
    receiver: str
    ciphertext: bytes = field(repr=False)
    signature: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        check_id(self.sender, "EncryptedShare sender")
        check_id(self.receiver, "EncryptedShare receiver")
        check_bytes(self.ciphertext, CIPHERTEXT_LEN, "EncryptedShare ciphertext")
        if self.signature:
            check_bytes(self.signature, SIGNATURE_LEN, "EncryptedShare signature")


@dataclass(frozen=True)
class ShareBatch:
    """Stage 2: all shares ``device`` sends (device -> server), or all it receives (server -> device)."""

    round: int
    device: str
    shares: tuple[EncryptedShare, ...]

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "ShareBatch device")
        object.__setattr__(self, "shares", tuple(self.shares))
        if len(self.shares) > MAX_ENTRIES:
            raise SecAggError(f"ShareBatch: {len(self.shares)} shares exceed the limit {MAX_ENTRIES}")
        if not all(isinstance(s, EncryptedShare) for s in self.shares):
            raise SecAggError("ShareBatch shares must be EncryptedShares")
        if len({(s.sender, s.receiver) for s in self.shares}) != len(self.shares):
            raise SecAggError("ShareBatch: duplicate (sender, receiver) pair")
        if len({bool(s.signature) for s in self.shares}) > 1:
            raise SecAggError("ShareBatch: some shares signed, some not")

    def to_bytes(self) -> bytes:
        signed = bool(self.shares) and bool(self.shares[0].signature)
        body = b"".join(pack_id(s.sender) + pack_id(s.receiver) + s.ciphertext + s.signature for s in self.shares)
        return (header(3, self.round) + pack_id(self.device) + pack_u16(len(self.shares), "ShareBatch count")
                + bytes([signed]) + body)

    @classmethod
    def from_bytes(cls, data: bytes) -> ShareBatch:
        r, round_id = open_message(data, 3, "ShareBatch")
        device = r.device("device")
        count = r.count("share count", MAX_ENTRIES)
        signed = r.u8("signed flag")
        if signed > 1:
            raise SecAggError(f"ShareBatch: signed flag {signed}, not 0 or 1")
        shares = tuple(EncryptedShare(r.device(f"share {i} sender"), r.device(f"share {i} receiver"),
                                      r.take(CIPHERTEXT_LEN, f"share {i} ciphertext"),
                                      r.take(SIGNATURE_LEN, f"share {i} signature") if signed else b"")
                       for i in range(count))
        r.done()
        return cls(round_id, device, shares)


@dataclass(frozen=True)
class ShareComplaint:
    """Stage 3, device -> server: the sealed share from ``accused`` does not open (or holds no share at this
    device's x); ``key`` is the complainer's private channel key of that pair only, so the coordinator can open the
    ciphertext itself and name the accused or, if it opens, the complainer (:mod:`.server_complaints`)."""

    round: int
    device: str
    accused: str
    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "ShareComplaint device")
        check_id(self.accused, "ShareComplaint accused")
        check_bytes(self.key, KEY_LEN, "ShareComplaint key")

    def to_bytes(self) -> bytes:
        return header(9, self.round) + pack_id(self.device) + pack_id(self.accused) + self.key

    @classmethod
    def from_bytes(cls, data: bytes) -> ShareComplaint:
        r, round_id = open_message(data, 9, "ShareComplaint")
        device, accused = r.device("device"), r.device("accused")
        key = r.take(KEY_LEN, "key")
        r.done()
        return cls(round_id, device, accused, key)
