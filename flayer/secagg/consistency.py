"""The consistency round of Bonawitz et al. (CCS 2017, Fig. 4, "ConsistencyCheck"): survivors sign the survivor set.

Between the masked inputs and the unmasking, the coordinator sends every survivor the **whole survivor set** S
(:class:`ConsistencyRequest`); the survivor signs ``(session, round, S)`` with its own long-term device key
(:class:`SurvivorSignature`) -- once per round, whatever it is asked again -- and the coordinator forwards the
signatures it collected in each unmask request. A device answers an unmask request only when

* the request's survivors and dropped are exactly its view of S (its surviving neighbours, and the neighbours
  whose shares it holds that are not in S), and
* it holds valid signatures over **the same S** from at least T distinct participants of the round, itself
  counted, where ``T = floor((P + c) / 2) + 1`` with P the round's participants and c = max(1, ceil(gamma P)) the
  colluders assumed (:func:`consistency_threshold`). Any participant may sign, a survivor or not (a **witness**:
  its keys, shares or masked input came late or never): the argument below counts signers among the P, whoever
  they are, so a device that missed a stage still helps a majority form; a witness sends no masked input after.

Why it holds: an honest device signs one set per round. Two different sets each carrying T signatures need
2T <= (P - c') + 2c' signers, c' the colluding devices (they may sign both), so c' >= 2T - P > c. With at most
c colluders, every honest device that answers was shown the same S; it then reveals of each neighbour v the
share of b_v if v is in S and of v's mask key if not -- one kind for every honest holder -- and both secrets of
an honest device need t colluding holders. The coordinator cannot forge a signature: the devices' public keys
come from the federation's key registry, never from the coordinator (the caller's ``verify``).

The threshold is global (a majority of the cohort), not the neighbourhood's t: a majority of one neighbourhood
binds nothing across two holders whose own neighbourhoods barely meet in a sparse graph. Its price: a round
in which fewer than T of the P selected devices are there to sign (survivors and witnesses) cannot be unmasked, and each device receives and
checks T signatures (measured in docs/results/secure-aggregation.md).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .keys import check_session
from .prg import Entropy

__all__ = ["SIGNATURE_LEN", "AdmitCert", "DeviceConsistency", "LocalIdentities", "ServerConsistency", "consistency_threshold",
           "survivor_set_message"]

SIGNATURE_LEN = 64  # Ed25519
_DOMAIN = b"flayer-secagg/v1/survivor-set\x00"
_U32 = struct.Struct("<I")

Sign = Callable[[bytes], bytes]  # this device's signature over the bytes (its long-term key)
Verify = Callable[[str, bytes, bytes], bool]  # (device, data, signature): True when that device's key signed it
# (device, its certificate from an advert or a request): why it is refused, or None -- the certificate's key is then
# that device's key for the round's ``verify`` (protocol.certs.RoundCerts)
AdmitCert = Callable[[str, bytes], "str | None"]


def consistency_threshold(participants: int, corrupt_fraction: float = 0.0) -> int:
    """T: the signatures over one survivor set a device needs before it unmasks (module docstring): a strict
    majority of the P participants and the c = max(1, ceil(gamma P)) colluders assumed, at most P."""
    if not isinstance(participants, int) or participants < 2:
        raise ValueError(f"participants must be an integer >= 2, got {participants!r}")
    if not 0 <= corrupt_fraction < 0.5:
        raise ValueError(f"corrupt_fraction must be in [0, 0.5), got {corrupt_fraction!r}")
    colluders = max(1, math.ceil(corrupt_fraction * participants - 1e-9))
    return min(participants, (participants + colluders) // 2 + 1)


def survivor_set_message(session: str, round_id: int, survivors: Iterable[str], transcript: bytes) -> bytes:
    """The bytes a survivor signs: domain, session, round, the sorted survivor set and the plan digest it acted on
    (:attr:`~flayer.secagg.params.SecAggParams.transcript`): a signature over the same set under another plan --
    another cohort, k, t or T -- counts for nobody reading this one."""
    ids = sorted(survivors)
    body = b"".join(bytes([len(d)]) + d.encode("ascii") for d in ids)
    session_raw = check_session(session).encode()
    return (_DOMAIN + bytes([len(session_raw)]) + session_raw + _U32.pack(round_id) + _U32.pack(len(ids)) + body
            + bytes(transcript))


@dataclass(frozen=True)
class DeviceConsistency:
    """What a device needs for the consistency round and the signed key adverts: its own signer, the federation's keys
    of the others (``verify``: never keys the coordinator supplies), and the colluding fraction it assumes (T's
    floor)."""

    sign: Sign
    verify: Verify
    corrupt_fraction: float = 0.0
    # the key adverts' signer and verifier (:mod:`.signed_adverts`; None: ``sign`` / ``verify``, as in process, where
    # the messages' own domains keep them apart; a real device binds another purpose: protocol.signing.advert_signer)
    sign_advert: Sign | None = None
    verify_advert: Verify | None = None
    cert: bytes = b""  # this device's certificate, carried in its advert (empty: keys from a registry)
    admit_cert: AdmitCert | None = None  # checks the neighbours' and signers' certificates (None: a registry)

    def __post_init__(self) -> None:
        if not 0 <= self.corrupt_fraction < 0.5:
            raise ValueError(f"corrupt_fraction must be in [0, 0.5), got {self.corrupt_fraction!r}")


@dataclass(frozen=True)
class ServerConsistency:
    """The coordinator's side: the colluding fraction of the plan (T) and the devices' keys (``verify``: a signature
    that does not verify is not forwarded; None forwards what arrives, the devices check anyway)."""

    verify: Verify | None = None
    corrupt_fraction: float = 0.0
    verify_advert: Verify | None = None  # the key adverts' signatures (None: ``verify``; :mod:`.signed_adverts`)
    admit_cert: AdmitCert | None = None  # each advert's certificate, checked on arrival (None: a registry)
    cert_of: Callable[[str], bytes] | None = None  # a signer's certificate, forwarded with its survivor signature

    def __post_init__(self) -> None:
        if not 0 <= self.corrupt_fraction < 0.5:
            raise ValueError(f"corrupt_fraction must be in [0, 0.5), got {self.corrupt_fraction!r}")


def count_valid(message: bytes, members: frozenset[str], signatures: Sequence[tuple[str, bytes]],
                verify: Verify) -> set[str]:
    """The distinct ``members`` (the round's participants) whose signature over ``message`` verifies (others are
    ignored)."""
    good: set[str] = set()
    for signer, sig in signatures:
        if signer in members and signer not in good and len(sig) == SIGNATURE_LEN and verify(signer, message, sig):
            good.add(signer)
    return good


class LocalIdentities:
    """Long-term Ed25519 keys of in-process devices (the simulator, tests, benchmarks): each device's signer and
    everyone's verifier, the keys drawn from ``entropy`` (reproducible with a seeded one: nothing in-process is
    secret from the process)."""

    def __init__(self, devices: Iterable[str], entropy: Entropy) -> None:
        self._keys = {d: Ed25519PrivateKey.from_private_bytes(bytes(entropy(32))) for d in devices}
        self._public: dict[str, Ed25519PublicKey] = {d: k.public_key() for d, k in self._keys.items()}

    def verify(self, device: str, data: bytes, signature: bytes) -> bool:
        key = self._public.get(device)
        if key is None:
            return False
        try:
            key.verify(bytes(signature), bytes(data))
        except InvalidSignature:
            return False
        return True

    def signer(self, device: str) -> Sign:
        return self._keys[device].sign

    def for_device(self, device: str, corrupt_fraction: float = 0.0) -> DeviceConsistency:
        return DeviceConsistency(self.signer(device), self.verify, corrupt_fraction)
