"""Key agreement, key derivation and authenticated encryption of the secure-aggregation round.

Bonawitz et al. (CCS 2017, Sec. 3 and Fig. 4) give each device u two Diffie-Hellman pairs per round:
``(c_u^PK, c_u^SK)`` to encrypt the shares it sends its neighbours and ``(s_u^PK, s_u^SK)`` for the
pairwise mask seeds. Here both are X25519 (RFC 7748). One agreement feeds one HKDF-SHA256 (RFC 5869)
derivation:

* ``derive_mask_seed(KA(s_u, s_v), ...)`` -> the 32-byte seed s_uv of the pairwise mask PRG(s_uv);
* ``derive_aead_key(KA(c_u, c_v), ...)`` -> the 32-byte ChaCha20-Poly1305 key c_uv.

Each ``info`` holds a domain string (``flayer-secagg/v1/mask-seed`` or ``.../aead-key``), the session
id, the round and the pair's two ids in sorted order, so a seed or key of one round, session or pair
is never that of another. The two purposes use *different* key pairs on purpose: when u drops out
the coordinator reconstructs s_u^SK to remove u's pairwise masks, and that must not open the share
ciphertexts u sent (which would hand it shares of u's self-mask seed too).

Each ciphertext is ``nonce (12 random bytes) || ChaCha20-Poly1305(c_uv, nonce, plaintext, ad)`` where
the associated data binds (session, round, sender, receiver, stage, the round's plan digest): a ciphertext
replayed from another round, session or plan, altered in one byte, or delivered to another device fails to
decrypt with
:class:`~flayer.secagg.errors.SecAggError`.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import SecAggError
from .prg import Entropy

__all__ = [
    "COMMIT_LEN",
    "KEY_LEN",
    "NONCE_LEN",
    "TAG_LEN",
    "KeyPair",
    "agree",
    "associated_data",
    "check_public_key",
    "check_session",
    "commit_seed",
    "derive_aead_key",
    "derive_mask_seed",
    "generate_keypair",
    "open_sealed",
    "public_from_private",
    "seal",
]

KEY_LEN = 32
COMMIT_LEN = 32
_PROBE = bytes([9] + [0] * 30 + [64])  # a fixed scalar: low-order public keys give an all-zero agreement with it
_P = 2**255 - 19  # Curve25519's field prime: a canonical u is below it
NONCE_LEN = 12
TAG_LEN = 16
_DOMAIN = b"flayer-secagg/v1/"
_SESSION = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class KeyPair:
    """An X25519 pair as raw bytes (the private half is what Shamir shares for s_u^SK)."""

    private: bytes = field(repr=False)
    public: bytes


def check_session(session: object) -> str:
    if not isinstance(session, str) or not _SESSION.fullmatch(session):
        raise ValueError(f"session id {session!r} must be 1-128 characters of letters, digits or _ . : / -")
    return session


def generate_keypair(entropy: Entropy) -> KeyPair:
    """A fresh X25519 pair from 32 bytes of ``entropy`` (RFC 7748 clamps the scalar)."""
    private = bytes(entropy(KEY_LEN))
    if len(private) != KEY_LEN:
        raise ValueError(f"entropy returned {len(private)} bytes, expected {KEY_LEN}")
    return KeyPair(private, public_from_private(private))


def public_from_private(private: bytes) -> bytes:
    if not isinstance(private, (bytes, bytearray)) or len(private) != KEY_LEN:
        raise SecAggError(f"private key must be {KEY_LEN} bytes")
    return X25519PrivateKey.from_private_bytes(bytes(private)).public_key().public_bytes_raw()


def agree(private: bytes, peer_public: bytes) -> bytes:
    """The X25519 shared secret; SecAggError for a malformed or low-order peer key (all-zero output)."""
    if not isinstance(peer_public, (bytes, bytearray)) or len(peer_public) != KEY_LEN:
        raise SecAggError(f"public key must be {KEY_LEN} bytes")
    try:
        return X25519PrivateKey.from_private_bytes(bytes(private)).exchange(
            X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError as exc:  # the library refuses an all-zero shared secret (a low-order point)
        raise SecAggError(f"key agreement failed: {exc}") from None


def check_public_key(public: bytes, what: str) -> None:
    """SecAggError unless ``public`` is a usable X25519 key: 32 bytes in the canonical encoding (u < p, the top bit
    clear: X25519 ignores that bit and reads u + p as u, so one key has several encodings and a repeated key would
    pass a byte comparison), whose agreement with a fixed scalar is not all-zero (an all-zero key and the other
    low-order points give every peer the all-zero secret)."""
    if isinstance(public, (bytes, bytearray)) and len(public) == KEY_LEN \
            and int.from_bytes(bytes(public), "little") >= _P:
        raise SecAggError(f"{what} is not a canonical X25519 key (top bit set, or u >= 2^255 - 19): another "
                          "encoding of some key")
    try:
        agree(_PROBE, public)
    except SecAggError as exc:
        raise SecAggError(f"{what} is no usable X25519 key (all-zero or low-order): {exc}") from None


def commit_seed(seed: bytes, session: str, round_id: int, device: str) -> bytes:
    """SHA-256 commitment to a device's self-mask seed b_u (32 random bytes: hiding), bound to session, round
    and device; the coordinator checks the b_u it rebuilds against it and names the holders of false shares."""
    h = hashes.Hash(hashes.SHA256())
    h.update(_DOMAIN + b"b-commit\x00" + _lp(check_session(session).encode()) + _U32.pack(round_id)
             + _lp(device.encode()) + bytes(seed))
    return h.finalize()


def _lp(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def _info(purpose: bytes, session: str, round_id: int, a: str, b: str) -> bytes:
    if not isinstance(round_id, int) or not 0 <= round_id <= 0xFFFFFFFF:
        raise ValueError(f"round must be an integer in [0, 2^32), got {round_id!r}")
    lo, hi = sorted((a, b))
    return (_DOMAIN + purpose + b"\x00" + _lp(check_session(session).encode()) + _U32.pack(round_id)
            + _lp(lo.encode()) + _lp(hi.encode()))


def _hkdf(shared: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_LEN, salt=None, info=info).derive(shared)


def derive_mask_seed(shared: bytes, session: str, round_id: int, a: str, b: str) -> bytes:
    """s_uv from KA(s_u, s_v): the same for (a, b) and (b, a)."""
    return _hkdf(shared, _info(b"mask-seed", session, round_id, a, b))


def derive_aead_key(shared: bytes, session: str, round_id: int, a: str, b: str) -> bytes:
    """c_uv from KA(c_u, c_v): the same for (a, b) and (b, a)."""
    return _hkdf(shared, _info(b"aead-key", session, round_id, a, b))


def associated_data(session: str, round_id: int, sender: str, receiver: str, stage: int, transcript: bytes) -> bytes:
    """What a ciphertext is bound to: session, round, sender, receiver (in this order), stage and the plan digest
    both parties relied on (:attr:`~flayer.secagg.params.SecAggParams.transcript`): a share sealed under one plan
    does not authenticate under another, so it is never complained of."""
    if not isinstance(stage, int) or not 0 <= stage <= 255:
        raise ValueError(f"stage must be an integer in [0, 255], got {stage!r}")
    if not isinstance(round_id, int) or not 0 <= round_id <= 0xFFFFFFFF:
        raise ValueError(f"round must be an integer in [0, 2^32), got {round_id!r}")
    return (_DOMAIN + b"ad\x00" + _lp(check_session(session).encode()) + _U32.pack(round_id)
            + _lp(sender.encode()) + _lp(receiver.encode()) + bytes([stage]) + _lp(bytes(transcript)))


def seal(key: bytes, plaintext: bytes, ad: bytes, entropy: Entropy) -> bytes:
    """``nonce || ciphertext || tag`` (ChaCha20-Poly1305, RFC 8439) with a random 12-byte nonce."""
    nonce = bytes(entropy(NONCE_LEN))
    if len(nonce) != NONCE_LEN:
        raise ValueError(f"entropy returned {len(nonce)} bytes, expected {NONCE_LEN}")
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, ad)


def open_sealed(key: bytes, sealed: bytes, ad: bytes, what: str) -> bytes:
    """The plaintext of :func:`seal`'s output; SecAggError naming ``what`` if it does not authenticate."""
    if len(sealed) < NONCE_LEN + TAG_LEN:
        raise SecAggError(f"{what}: ciphertext of {len(sealed)} bytes is too short")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_LEN], sealed[NONCE_LEN:], ad)
    except InvalidTag:
        raise SecAggError(f"{what} does not authenticate: replayed from another round or session, "
                          "altered, or addressed to another device") from None
