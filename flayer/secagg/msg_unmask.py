"""Stage 3 and 4 messages: the masked input, the unmask request and the revealed shares (layout: :mod:`.messages`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._wire import (
    MAX_ENTRIES,
    check_bytes,
    check_id,
    check_list,
    check_round,
    header,
    open_message,
    pack_id,
    pack_u16,
    pack_u32,
)
from .consistency import SIGNATURE_LEN
from .errors import SecAggError
from .msg_setup import MAX_CERT_LEN
from .packing import pack_values, packed_size, unpack_values
from .prg import MAX_LENGTH
from .shamir import SHARE_LEN

__all__ = ["MIN_BITS", "ConsistencyRequest", "MaskedInput", "SurvivorSignature", "UnmaskRequest", "UnmaskShares"]

MIN_BITS = 2  # the narrowest ring (flayer.secagg.ring.RingSpec)
PAIR_SEED_LEN = 32  # a pairwise mask seed (keys.derive_mask_seed)
MAX_SET = 0xFFFF  # a whole round's survivors (participants travel as u16 Shamir x)


def _check_set(ids: tuple[str, ...], what: str) -> None:
    if len(ids) > MAX_SET:
        raise SecAggError(f"{what}: {len(ids)} entries exceed the limit {MAX_SET}")
    for i in ids:
        check_id(i, what)
    if len(set(ids)) != len(ids):
        raise SecAggError(f"{what}: duplicate device")


def _check_signatures(sigs: tuple[tuple[str, bytes], ...], what: str) -> None:
    _check_set(tuple(s for s, _ in sigs), what)
    for signer, sig in sigs:
        check_bytes(sig, SIGNATURE_LEN, f"{what} of {signer}")


def _pack_signatures(sigs: tuple[tuple[str, bytes], ...]) -> bytes:
    return pack_u16(len(sigs), "signatures") + b"".join(pack_id(s) + sig for s, sig in sigs)


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """Stage 3, device -> server: y_u, the masked vector in Z_{2^bits} (the round's ring width), packed at
    ``bits`` bits a coordinate (:mod:`.packing`): ``ceil(n bits / 8)`` bytes, not 4 n."""

    round: int
    device: str
    vector: np.ndarray = field(repr=False)
    bits: int = 32

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "MaskedInput device")
        b = self.bits
        if not isinstance(b, int) or isinstance(b, bool) or not MIN_BITS <= b <= 32:
            raise SecAggError(f"MaskedInput bits {b!r} must be an integer in [{MIN_BITS}, 32]")
        v = self.vector
        if not isinstance(v, np.ndarray) or v.dtype != np.uint32 or v.ndim != 1 or not 1 <= v.size <= MAX_LENGTH:
            raise SecAggError(f"MaskedInput vector must be a 1-D uint32 array of 1-{MAX_LENGTH} values")
        if b < 32 and int(v.max()) >> b:
            raise SecAggError(f"MaskedInput vector holds a value outside Z_2^{b}")

    def to_bytes(self) -> bytes:
        return (header(4, self.round) + pack_id(self.device) + bytes([self.bits])
                + pack_u32(self.vector.size, "length") + pack_values(self.vector, self.bits))

    @classmethod
    def from_bytes(cls, data: bytes) -> MaskedInput:
        r, round_id = open_message(data, 4, "MaskedInput")
        device = r.device("device")
        bits = r.u8("bits")
        if not MIN_BITS <= bits <= 32:
            raise SecAggError(f"MaskedInput: bits {bits} outside [{MIN_BITS}, 32]")
        n = r.u32("length")
        if not 1 <= n <= MAX_LENGTH:
            raise SecAggError(f"MaskedInput: length {n} outside [1, {MAX_LENGTH}]")
        try:
            vector = unpack_values(r.take(packed_size(n, bits), "vector"), n, bits)
        except ValueError as exc:
            raise SecAggError(f"MaskedInput: {exc}") from None
        r.done()
        return cls(round_id, device, vector, bits)


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 4, server -> device: which of its neighbours survived (sent y) and which dropped after stage 2.

    ``survivors`` includes the device itself; ``survivor_count`` is the size of the whole survivor set;
    ``signatures`` the survivors' signatures over the survivor set (the consistency round: :mod:`.consistency`);
    ``certs`` the signers' certificates from the federation's authority, in the signatures' order (the device checks
    each against the authority itself; empty where devices' keys come from a registry); ``consents`` the consent of
    each listed survivor but the device itself (:mod:`.msg_consent`): the device reveals its share of b_u only for a u whose consent it
    verifies itself.
    """

    round: int
    device: str
    survivor_count: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    signatures: tuple[tuple[str, bytes], ...] = ()
    certs: tuple[bytes, ...] = field(default=(), repr=False)
    consents: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "UnmaskRequest device")
        object.__setattr__(self, "consents", tuple((s, sig) for s, sig in self.consents))
        if len(self.consents) > MAX_ENTRIES:
            raise SecAggError(f"UnmaskRequest consents: {len(self.consents)} entries exceed the limit {MAX_ENTRIES}")
        _check_signatures(self.consents, "UnmaskRequest consent")
        object.__setattr__(self, "certs", tuple(self.certs))
        if self.certs and len(self.certs) != len(self.signatures):
            raise SecAggError("UnmaskRequest: certs are one per signature, or none")
        if not all(isinstance(c, bytes) and len(c) <= MAX_CERT_LEN for c in self.certs):
            raise SecAggError(f"UnmaskRequest cert: bytes of at most {MAX_CERT_LEN}")
        object.__setattr__(self, "survivors", tuple(self.survivors))
        object.__setattr__(self, "dropped", tuple(self.dropped))
        check_list(self.survivors, "UnmaskRequest survivors")
        check_list(self.dropped, "UnmaskRequest dropped")
        object.__setattr__(self, "signatures", tuple((s, sig) for s, sig in self.signatures))
        _check_signatures(self.signatures, "UnmaskRequest signature")
        if not isinstance(self.survivor_count, int) or not 0 <= self.survivor_count <= 0xFFFFFFFF:
            raise SecAggError(f"UnmaskRequest survivor_count {self.survivor_count!r} is not a u32")

    def to_bytes(self) -> bytes:
        return (header(5, self.round) + pack_id(self.device) + pack_u32(self.survivor_count, "survivor_count")
                + pack_u16(len(self.survivors), "survivors") + b"".join(pack_id(s) for s in self.survivors)
                + pack_u16(len(self.dropped), "dropped") + b"".join(pack_id(d) for d in self.dropped)
                + _pack_signatures(self.signatures) + pack_u16(len(self.certs), "certs")
                + b"".join(pack_u16(len(c), "cert") + c for c in self.certs) + _pack_signatures(self.consents))

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskRequest:
        r, round_id = open_message(data, 5, "UnmaskRequest")
        device, count = r.device("device"), r.u32("survivor_count")
        survivors = tuple(r.device(f"survivor {i}") for i in range(r.count("survivors", MAX_ENTRIES)))
        dropped = tuple(r.device(f"dropped {i}") for i in range(r.count("dropped", MAX_ENTRIES)))
        sigs = tuple((r.device(f"signer {i}"), r.take(SIGNATURE_LEN, f"signature {i}"))
                     for i in range(r.count("signatures", MAX_SET)))
        certs = tuple(r.take(r.count(f"cert {i} length", MAX_CERT_LEN), f"cert {i}")
                      for i in range(r.count("certs", MAX_SET)))
        consents = tuple((r.device(f"consent {i} device"), r.take(SIGNATURE_LEN, f"consent {i}"))
                         for i in range(r.count("consents", MAX_ENTRIES)))
        r.done()
        return cls(round_id, device, count, survivors, dropped, sigs, certs, consents)


@dataclass(frozen=True)
class UnmaskShares:
    """Stage 4, device -> server: its shares of b_v for surviving v, of s_v for dropped v (68 B each), and for a
    dropped v whose shares it does not hold (they did not open: a complaint, or not signed) the pairwise mask seed
    it masked with toward v (``pair_seeds``, 32 B each): v is out of the sum, so only that pair's mask is removed."""

    round: int
    device: str
    b_shares: tuple[tuple[str, bytes], ...]
    s_shares: tuple[tuple[str, bytes], ...]
    pair_seeds: tuple[tuple[str, bytes], ...] = ()

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "UnmaskShares device")
        for name in ("b_shares", "s_shares"):
            entries = tuple(getattr(self, name))
            object.__setattr__(self, name, entries)
            check_list(tuple(owner for owner, _ in entries), f"UnmaskShares {name}")
            for owner, share in entries:
                check_bytes(share, SHARE_LEN, f"UnmaskShares {name} share of {owner}")
        seeds = tuple((o, bytes(v)) for o, v in self.pair_seeds)
        object.__setattr__(self, "pair_seeds", seeds)
        check_list(tuple(owner for owner, _ in seeds), "UnmaskShares pair_seeds")
        for owner, seed in seeds:
            check_bytes(seed, PAIR_SEED_LEN, f"UnmaskShares pair seed toward {owner}")
        both = {o for o, _ in self.b_shares} & ({o for o, _ in self.s_shares} | {o for o, _ in seeds})
        if both:
            raise SecAggError(f"UnmaskShares reveals both shares of {sorted(both)}")

    def to_bytes(self) -> bytes:
        def block(entries: tuple[tuple[str, bytes], ...], what: str) -> bytes:
            return pack_u16(len(entries), what) + b"".join(pack_id(o) + s for o, s in entries)

        return (header(6, self.round) + pack_id(self.device) + block(self.b_shares, "b_shares")
                + block(self.s_shares, "s_shares") + block(self.pair_seeds, "pair_seeds"))

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskShares:
        r, round_id = open_message(data, 6, "UnmaskShares")
        device = r.device("device")
        blocks = []
        for name in ("b_shares", "s_shares"):
            count = r.count(f"{name} count", MAX_ENTRIES)
            blocks.append(tuple((r.device(f"{name} {i} owner"), r.take(SHARE_LEN, f"{name} {i} share"))
                                for i in range(count)))
        count = r.count("pair_seeds count", MAX_ENTRIES)
        seeds = tuple((r.device(f"pair seed {i} owner"), r.take(PAIR_SEED_LEN, f"pair seed {i}")) for i in range(count))
        r.done()
        return cls(round_id, device, blocks[0], blocks[1], seeds)


@dataclass(frozen=True)
class ConsistencyRequest:
    """Consistency round, server -> device: the whole survivor set S, for the device to sign (:mod:`.consistency`)."""

    round: int
    device: str
    survivors: tuple[str, ...]

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "ConsistencyRequest device")
        object.__setattr__(self, "survivors", tuple(self.survivors))
        _check_set(self.survivors, "ConsistencyRequest survivors")

    def to_bytes(self) -> bytes:
        return (header(7, self.round) + pack_id(self.device) + pack_u16(len(self.survivors), "survivors")
                + b"".join(pack_id(s) for s in self.survivors))

    @classmethod
    def from_bytes(cls, data: bytes) -> ConsistencyRequest:
        r, round_id = open_message(data, 7, "ConsistencyRequest")
        device = r.device("device")
        survivors = tuple(r.device(f"survivor {i}") for i in range(r.count("survivors", MAX_SET)))
        r.done()
        return cls(round_id, device, survivors)


@dataclass(frozen=True)
class SurvivorSignature:
    """Consistency round, device -> server: its Ed25519 signature over the survivor set it was shown (64 B)."""

    round: int
    device: str
    signature: bytes = field(repr=False)

    def __post_init__(self) -> None:
        check_round(self.round)
        check_id(self.device, "SurvivorSignature device")
        check_bytes(self.signature, SIGNATURE_LEN, "SurvivorSignature signature")

    def to_bytes(self) -> bytes:
        return header(8, self.round) + pack_id(self.device) + self.signature

    @classmethod
    def from_bytes(cls, data: bytes) -> SurvivorSignature:
        r, round_id = open_message(data, 8, "SurvivorSignature")
        device = r.device("device")
        sig = r.take(SIGNATURE_LEN, "signature")
        r.done()
        return cls(round_id, device, sig)
