"""Device certificates and the signed revocation list: a federation's authority vouches for each device's key.

The federation's **authority** is an Ed25519 key pair the admin's tooling keeps (``flayer broker``; the private half
never leaves the broker's state folder, and the coordinator never holds it). It signs two kinds of statement:

- a **device certificate**: (federation, device id, device public key, serial, issued time) under the purpose tag
  :data:`CERT_PURPOSE`. What is signed is the :class:`~protocol.signing.SignContext` prefix (domain, purpose,
  federation, device id, serial as u64 LE) followed by the 32 raw bytes of the device's key and the issued time
  (u64 LE): one canonical encoding, so a certificate for one device, federation or serial verifies under no other.
  A re-keyed device gets a certificate with a higher serial; the older one is put on the list below.
- a **revocation list**: (federation, version, issued time, entries) under :data:`REVOCATIONS_PURPOSE`, each entry
  a device id and the serial of a certificate it revokes (``"*"``: every certificate of the device, a revoked
  device). The version only grows; a receiver keeps the highest it has seen and refuses a lower one (a rollback
  that would make a revoked certificate believed again).

Both travel as JSON text (a certificate's ``sig`` and the list's ``sig`` are base64url of 64 bytes); parsing checks
the signature against the authority's public key the receiver pinned (its kit's), the federation and every field,
and raises :class:`~protocol.signing.SignatureError` naming what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .signing import SignatureError, SignContext, SigningKey, VerifyKey
from .topics import TopicError, validate_id

__all__ = ["ALL_SERIALS", "AUTHORITY_SENDER", "CERT_PURPOSE", "MAX_CERT_BYTES", "MAX_REVOCATIONS",
           "REVOCATIONS_PURPOSE", "DeviceCert", "Revocations", "RoundCerts", "issue_cert", "parse_cert",
           "parse_revocations", "sign_revocations"]

CERT_PURPOSE = "flayer:device-cert/v1"
REVOCATIONS_PURPOSE = "flayer:revocations/v1"
AUTHORITY_SENDER = "authority"  # the "sender" a revocation list is bound to (a certificate binds the device id)
ALL_SERIALS = "*"
MAX_CERT_BYTES = 4096
MAX_REVOCATIONS = 100_000
MAX_REVOCATIONS_BYTES = 8 << 20
_U64 = struct.Struct("<Q")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise SignatureError(f"{what} must be base64 text")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise SignatureError(f"{what} is not valid base64") from None


def _uint(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        raise SignatureError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _json(text: str | bytes, limit: int, what: str) -> dict[str, object]:
    if len(text) > limit:
        raise SignatureError(f"{what}: over {limit} bytes")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SignatureError(f"{what}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SignatureError(f"{what}: expected a JSON object")
    return data


@dataclass(frozen=True)
class DeviceCert:
    """The authority's word that ``key`` is ``device``'s key in ``federation`` (certificate ``serial``)."""

    federation: str
    device: str
    key: VerifyKey
    serial: int
    issued: int
    signature: bytes

    def signed_bytes(self) -> tuple[SignContext, bytes]:
        return (SignContext(self.federation, self.serial, self.device, CERT_PURPOSE),
                _raw_key(self.key) + _U64.pack(self.issued))

    def to_text(self) -> str:
        return json.dumps({"v": 1, "purpose": CERT_PURPOSE, "federation": self.federation, "device": self.device,
                           "key": self.key.text, "serial": self.serial, "issued": self.issued,
                           "sig": _b64(self.signature)}, sort_keys=True)


def _raw_key(key: VerifyKey) -> bytes:
    body = key.text.split(":", 1)[1]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def issue_cert(authority: SigningKey, federation: str, device: str, key: VerifyKey, serial: int,
               issued: int) -> DeviceCert:
    """The authority's certificate of ``device``'s ``key`` (serial >= 1)."""
    unsigned = DeviceCert(federation, device, key, _uint(serial, "serial"), _uint(issued, "issued"), b"")
    ctx, data = unsigned.signed_bytes()
    return DeviceCert(federation, device, key, serial, issued, authority.sign(ctx, data))


def parse_cert(text: str | bytes, authority: VerifyKey, federation: str) -> DeviceCert:
    """A certificate the ``authority`` signed for ``federation``; SignatureError naming what is wrong."""
    data = _json(text, MAX_CERT_BYTES, "device certificate")
    if data.get("v") != 1 or data.get("purpose") != CERT_PURPOSE:
        raise SignatureError(f"device certificate: not a {CERT_PURPOSE} certificate")
    if set(data) != {"v", "purpose", "federation", "device", "key", "serial", "issued", "sig"}:
        raise SignatureError("device certificate: unexpected or missing fields")
    fed, device = data["federation"], data["device"]
    if fed != federation:
        raise SignatureError(f"device certificate of federation {fed!r}, not {federation!r}")
    try:
        validate_id(device, "device id")  # type: ignore[arg-type]
    except TopicError as exc:
        raise SignatureError(f"device certificate: {exc}") from None
    cert = DeviceCert(federation, str(device), VerifyKey.from_text(data["key"], "certified key"),
                      _uint(data["serial"], "serial"), _uint(data["issued"], "issued"),
                      _unb64(data["sig"], "certificate signature"))
    ctx, signed = cert.signed_bytes()
    try:
        authority.verify(ctx, signed, cert.signature)
    except SignatureError:
        raise SignatureError(f"device certificate of {device!r} (serial {cert.serial}) is not signed by this "
                             "federation's authority") from None
    return cert


@dataclass(frozen=True)
class Revocations:
    """The authority's list of revoked certificates: ``entries`` of (device id, serial or :data:`ALL_SERIALS`)."""

    federation: str
    version: int
    issued: int
    entries: tuple[tuple[str, str], ...]
    signature: bytes = b""

    def revokes(self, device: str, serial: int) -> bool:
        return any(d == device and (s == ALL_SERIALS or s == str(serial)) for d, s in self.entries)

    def _signed(self) -> tuple[SignContext, bytes]:
        body = json.dumps([list(e) for e in self.entries], separators=(",", ":")).encode()
        return (SignContext(self.federation, self.version, AUTHORITY_SENDER, REVOCATIONS_PURPOSE),
                _U64.pack(self.issued) + body)

    def to_text(self) -> str:
        return json.dumps({"v": 1, "purpose": REVOCATIONS_PURPOSE, "federation": self.federation,
                           "version": self.version, "issued": self.issued, "entries": [list(e) for e in self.entries],
                           "sig": _b64(self.signature)}, indent=None, sort_keys=True) + "\n"


def sign_revocations(authority: SigningKey, federation: str, version: int, issued: int,
                     entries: Iterable[tuple[str, str]]) -> Revocations:
    unsigned = Revocations(federation, _uint(version, "version"), _uint(issued, "issued"),
                           tuple(sorted(set(entries))))
    ctx, data = unsigned._signed()
    return Revocations(federation, version, issued, unsigned.entries, authority.sign(ctx, data))


def parse_revocations(text: str | bytes, authority: VerifyKey, federation: str) -> Revocations:
    """A revocation list the ``authority`` signed for ``federation``; SignatureError naming what is wrong."""
    data = _json(text, MAX_REVOCATIONS_BYTES, "revocation list")
    if data.get("v") != 1 or data.get("purpose") != REVOCATIONS_PURPOSE:
        raise SignatureError(f"revocation list: not a {REVOCATIONS_PURPOSE} list")
    if set(data) != {"v", "purpose", "federation", "version", "issued", "entries", "sig"}:
        raise SignatureError("revocation list: unexpected or missing fields")
    if data["federation"] != federation:
        raise SignatureError(f"revocation list of federation {data['federation']!r}, not {federation!r}")
    raw = data["entries"]
    if not isinstance(raw, list) or len(raw) > MAX_REVOCATIONS:
        raise SignatureError(f"revocation list: entries must be a list of at most {MAX_REVOCATIONS}")
    entries = []
    for e in raw:
        if not (isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)
                and (e[1] == ALL_SERIALS or (e[1].isdigit() and len(e[1]) < 19))):
            raise SignatureError(f"revocation list: entry {e!r} is not [device id, serial or '*']")
        try:
            validate_id(e[0], "device id")
        except TopicError as exc:
            raise SignatureError(f"revocation list: {exc}") from None
        entries.append((e[0], e[1]))
    revs = Revocations(federation, _uint(data["version"], "version"), _uint(data["issued"], "issued"),
                       tuple(entries), _unb64(data["sig"], "revocation list signature"))
    if list(revs.entries) != sorted(set(revs.entries)):
        raise SignatureError("revocation list: entries not sorted and unique (not as the authority writes them)")
    ctx, signed = revs._signed()
    try:
        authority.verify(ctx, signed, revs.signature)
    except SignatureError:
        raise SignatureError(f"revocation list version {revs.version} is not signed by this federation's "
                             "authority") from None
    return revs


class RoundCerts:
    """One secure round's device keys, each from the certificate that device's advert (or the request forwarding its
    signature) carried: ``admit`` checks a certificate against the pinned ``authority``, the federation, the device
    it is offered for and the current signed revocation list (``revocations``); ``key_for`` (a
    :class:`~protocol.signing.Trust`) then answers that certificate's key, and nothing else. The first certificate
    admitted for a device in the round stands. ``lookup``: where a certificate no message carried may be read (the
    coordinator: the broker folder's ``certs/``), for a signer whose advert never came."""

    def __init__(self, federation: str, authority: VerifyKey, revocations: Callable[[], Revocations | None],
                 lookup: Callable[[str], bytes | None] | None = None) -> None:
        self.federation, self.authority, self.revocations, self.lookup = federation, authority, revocations, lookup
        self._certs: dict[str, tuple[DeviceCert, bytes]] = {}

    def admit(self, device: str, raw: bytes) -> str | None:
        """Why ``raw`` is not a valid certificate of ``device`` now, or None (its key is then believed)."""
        if not raw:
            return "it carries no certificate"
        try:
            cert = parse_cert(raw, self.authority, self.federation)
        except SignatureError as exc:
            return str(exc)
        if cert.device != device:
            return f"it carries the certificate of {cert.device!r}, not its own"
        revs = self.revocations()
        if revs is not None and revs.revokes(device, cert.serial):
            return (f"its certificate (serial {cert.serial}) is revoked by the authority's revocation list "
                    f"(version {revs.version})")
        held = self._certs.get(device)
        if held is not None and (held[0].serial, held[0].key.text) != (cert.serial, cert.key.text):
            return f"another certificate of {device!r} (serial {held[0].serial}) stands in this round"
        self._certs[device] = (cert, bytes(raw))
        return None

    def cert_of(self, device: str) -> bytes:
        """The certificate admitted for ``device`` this round (or found by ``lookup``); empty when none."""
        if device not in self._certs and self.lookup is not None:
            raw = self.lookup(device)
            if raw:
                self.admit(device, raw)
        held = self._certs.get(device)
        return held[1] if held is not None else b""

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        if federation != self.federation:
            raise SignatureError(f"signed for federation {federation!r}, not {self.federation!r}")
        if not self.cert_of(sender):
            raise SignatureError(f"no valid certificate of {sender!r} reached this round")
        cert = self._certs[sender][0]
        revs = self.revocations()
        if revs is not None and revs.revokes(sender, cert.serial):
            raise SignatureError(f"certificate {cert.serial} of {sender!r} is revoked")
        return cert.key
