"""Ed25519 signatures bound to a context: who signs what, for which federation, round and purpose.

Every envelope of the wire carries one (docs/reference/wire.md): the coordinator signs what it publishes
(plans, acks, model and delta chunks, secure-round requests), each device signs what it sends (update
chunks, status, metrics, secure-round messages) with its own key, and every receiver checks the signature
against the key it already holds before the message changes anything -- the broker is trusted for delivery
only (docs/explanation/security.md).

The small API other modules call::

    key = SigningKey.generate()                        # a device's or the coordinator's private key
    ctx = SignContext("fed", 7, "dev-3", "secagg:survivors")
    sig = key.sign(ctx, data)                          # 64 bytes
    key.public.verify(ctx, data, sig)                  # None, or SignatureError

What is signed is ``DOMAIN || purpose || 0 || federation || 0 || sender || 0 || round (u64 LE) || data``:
a signature made for one purpose, federation, sender or round does not verify under any other, so a
message cannot be replayed into another federation, passed off as another sender's, or moved to another
round or kind without the verifier noticing. Keys travel as text, ``ed25519:<base64url of the 32 raw
bytes>`` (a private key's text is its seed: keep it in a 0600 file).
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import WireError
from .topics import TopicError, validate_id

__all__ = ["ADVERT", "DOMAIN", "KEY_PREFIX", "SIGNATURE_BYTES", "SURVIVORS", "KeyRing", "PeerTrust", "SignContext",
           "SignatureError", "SigningKey", "VerifyKey", "advert_signer", "advert_verifier", "key_problem",
           "parse_key_registry", "render_key_registry", "survivor_signer", "survivor_verifier"]

DOMAIN = b"FLAYER-EDGE-SIG-1\x00"
KEY_PREFIX = "ed25519:"
SIGNATURE_BYTES = 64
_U64 = struct.Struct("<Q")
_PURPOSE_MAX = 64
SURVIVORS = "secagg:survivors"  # a secure round's consistency round: a device signs the survivor set it was shown
ADVERT = "secagg:advert"  # a secure round's key advert: a device signs its keys toward each neighbour


class SignatureError(WireError):
    """A signature is missing, malformed or made by another key, or a key is unknown or malformed."""


@dataclass(frozen=True)
class SignContext:
    """What a signature is bound to: the federation, the round, the sender, the purpose (e.g. ``plan``)."""

    federation: str
    round: int
    sender: str
    purpose: str

    def prefix(self) -> bytes:
        try:
            validate_id(self.federation, "federation id")
            validate_id(self.sender, "sender id")
        except TopicError as exc:
            raise SignatureError(str(exc)) from None
        if not (isinstance(self.purpose, str) and 1 <= len(self.purpose) <= _PURPOSE_MAX
                and self.purpose.isascii() and "\x00" not in self.purpose):
            raise SignatureError(f"purpose {self.purpose!r} must be 1-{_PURPOSE_MAX} ASCII characters")
        if type(self.round) is not int or not 0 <= self.round < 2**64:
            raise SignatureError(f"round {self.round!r} out of range")
        return b"".join((DOMAIN, self.purpose.encode(), b"\x00", self.federation.encode(), b"\x00",
                         self.sender.encode(), b"\x00", _U64.pack(self.round)))


def _raw(text: object, what: str) -> bytes:
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise SignatureError(f"{what} must be text of the form '{KEY_PREFIX}<base64>'")
    body = text[len(KEY_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise SignatureError(f"{what} is not valid base64") from None
    if len(raw) != 32:
        raise SignatureError(f"{what} must hold 32 bytes, got {len(raw)}")
    return raw


def _text(raw: bytes) -> str:
    return KEY_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


class VerifyKey:
    """A public key: checks signatures made by its private half."""

    __slots__ = ("_key", "text")

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self.text = _text(key.public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def from_text(cls, text: object, what: str = "public key") -> VerifyKey:
        try:
            return cls(Ed25519PublicKey.from_public_bytes(_raw(text, what)))
        except ValueError as exc:
            if isinstance(exc, SignatureError):
                raise
            raise SignatureError(f"{what} is not an Ed25519 public key") from None

    def verify(self, ctx: SignContext, data: bytes | bytearray | memoryview, signature: bytes) -> None:
        """None when ``signature`` is this key's over ``data`` in ``ctx``; SignatureError otherwise."""
        if len(signature) != SIGNATURE_BYTES:
            raise SignatureError(f"signature of {len(signature)} bytes (expected {SIGNATURE_BYTES})")
        try:
            self._key.verify(bytes(signature), ctx.prefix() + bytes(data))
        except InvalidSignature:
            raise SignatureError(f"{ctx.purpose} from {ctx.sender!r} (round {ctx.round}): bad signature "
                                 f"(not signed by the key this side holds for it)") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerifyKey) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"VerifyKey({self.text!r})"


class SigningKey:
    """A private key. Its text is secret; ``repr`` shows only the public half."""

    __slots__ = ("_key", "public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = VerifyKey(key.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        """A new key from the operating system's cryptographic source."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_text(cls, text: object, what: str = "signing key") -> SigningKey:
        return cls(Ed25519PrivateKey.from_private_bytes(_raw(text, what)))

    def private_text(self) -> str:
        """The secret seed as text (for a 0600 credentials file only)."""
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        return _text(self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))

    def sign(self, ctx: SignContext, data: bytes | bytearray | memoryview) -> bytes:
        return self._key.sign(ctx.prefix() + bytes(data))

    def __repr__(self) -> str:
        return f"SigningKey(public={self.public.text!r})"


def key_problem(text: object, private: bool) -> str | None:
    """What is wrong with a key's text, or None."""
    try:
        (SigningKey if private else VerifyKey).from_text(text)
    except SignatureError as exc:
        return exc.reason
    return None


class PeerTrust:
    """A device's trust: one federation, one key (the coordinator's, from the device's kit) for every sender."""

    def __init__(self, federation: str, key: VerifyKey) -> None:
        self.federation, self.key = federation, key

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        if federation != self.federation:
            raise SignatureError(f"signed for federation {federation!r}, not {self.federation!r}")
        return self.key


class KeyRing:
    """One federation's senders and their keys (a mapping read when asked: it may change)."""

    def __init__(self, federation: str, keys: Mapping[str, VerifyKey]) -> None:
        self.federation, self.keys = federation, keys

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        if federation != self.federation:
            raise SignatureError(f"signed for federation {federation!r}, not {self.federation!r}")
        key = self.keys.get(sender)
        if key is None:
            raise SignatureError(f"no key known for {sender!r} (not a member, revoked, or re-keyed since)")
        return key


def parse_key_registry(text: str, what: str = "key registry") -> tuple[VerifyKey | None, dict[str, VerifyKey]]:
    """A federation's public keys, as the broker's state folder keeps them (``signing_keys.json``)::

        {"coordinator": "ed25519:...", "devices": {"dev-1": "ed25519:...", ...}}

    (the coordinator's key, device id -> key); SignatureError naming what is wrong."""
    import json

    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SignatureError(f"{what}: not JSON ({exc})") from None
    if not isinstance(data, dict) or set(data) - {"coordinator", "devices"} \
            or not isinstance(data.get("devices", {}), dict):
        raise SignatureError(f'{what}: expected {{"coordinator": KEY, "devices": {{ID: KEY}}}}')
    coord = VerifyKey.from_text(data["coordinator"], f"{what}: coordinator key") if data.get("coordinator") else None
    devices = {}
    for device, key in data.get("devices", {}).items():
        try:
            validate_id(device, "device id")
        except TopicError as exc:
            raise SignatureError(f"{what}: {exc}") from None
        devices[device] = VerifyKey.from_text(key, f"{what}: key of {device}")
    return coord, devices


def render_key_registry(coord: VerifyKey | None, devices: Mapping[str, VerifyKey]) -> str:
    import json

    return json.dumps({"coordinator": coord.text if coord else "",
                       "devices": {d: k.text for d, k in sorted(devices.items())}}, indent=1) + "\n"


def survivor_signer(key: SigningKey, federation: str, round_: int, device: str,
                    purpose: str = SURVIVORS) -> Callable[[bytes], bytes]:
    """A device's signer of a secure round's survivor set (:mod:`flayer.secagg.consistency`), bound to the
    federation, the round and the device (``purpose``: :data:`ADVERT` for its key adverts)."""
    ctx = SignContext(federation, round_, device, purpose)
    return lambda data: key.sign(ctx, data)


def survivor_verifier(trust: Any, federation: str, round_: int,
                      purpose: str = SURVIVORS) -> Callable[[str, bytes, bytes], bool]:
    """(device, data, signature) -> True when the key ``trust`` holds for that device signed the survivor set
    (``trust.key_for(federation, device)``: a registry of the federation's devices, never the coordinator's word)."""
    def verify(device: str, data: bytes, signature: bytes) -> bool:
        try:
            trust.key_for(federation, device).verify(SignContext(federation, round_, device, purpose), data,
                                                     signature)
        except SignatureError:
            return False
        return True

    return verify


def advert_signer(key: SigningKey, federation: str, round_: int, device: str) -> Callable[[bytes], bytes]:
    """A device's signer of its secure round's key advert toward each neighbour (:mod:`flayer.secagg.signed_adverts`),
    bound to the federation, the round, the device and the purpose :data:`ADVERT`."""
    return survivor_signer(key, federation, round_, device, ADVERT)


def advert_verifier(trust: Any, federation: str, round_: int) -> Callable[[str, bytes, bytes], bool]:
    """(device, data, signature) -> True when the key ``trust`` holds for that device signed the key advert (the
    coordinator's registry on receipt, a device's own copy before it seals a share)."""
    return survivor_verifier(trust, federation, round_, ADVERT)
