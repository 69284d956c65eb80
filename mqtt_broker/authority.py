"""The federation's authority: the key that makes kits, the device certificates it signs, its revocation list.

Kept in the broker's state folder by the admin's tooling (``flayer broker init|start|add-device|rekey|revoke``)::

    authority.key          the authority's Ed25519 private key (0600): it certifies devices. Only the admin's
                           tooling reads it; the coordinator process is never given it (it holds its own signing
                           key, and the authority's public key below), so a coordinator cannot mint a device.
    authority.pub          its public key: pinned in every kit
    certs/<device>.json    each device's current certificate (public; kept after a revocation, so a device added
                           again gets a higher serial)
    revocation_list.json   the signed, versioned revocation list (:mod:`protocol.certs`): published retained on
                           ``fl/<federation>/revocations`` (only the admin user may write there) and put in every kit

A state folder made before the authority existed gets one at the next admin command that needs it
(:func:`ensure_authority`, logged). Certificates: :func:`certify` issues one for a device's current key, with
the next serial, and lists the certificate it replaces (a re-keyed or rotated device); :func:`revoke_serial`
lists a revoked device's certificate. Callers hold the state folder's lock (:func:`mqtt_broker.state._locked`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from mqtt_broker.config import BrokerConfigError
from mqtt_broker.fsutil import atomic_write, private_dir
from protocol.certs import (
    DeviceCert,
    Revocations,
    issue_cert,
    parse_cert,
    parse_revocations,
    sign_revocations,
)
from protocol.signing import SignatureError, SigningKey, VerifyKey

__all__ = ["AUTHORITY_KEY", "AUTHORITY_PUB", "REVOCATION_LIST", "authority_public", "certify", "current_cert",
           "ensure_authority", "read_revocations", "revoke_serial"]

log = logging.getLogger(__name__)
AUTHORITY_KEY = "authority.key"
AUTHORITY_PUB = "authority.pub"
REVOCATION_LIST = "revocation_list.json"
CERTS_DIR = "certs"


def ensure_authority(state_dir: Path) -> SigningKey:
    """The authority's private key, created (0600) when the folder has none yet."""
    path = state_dir / AUTHORITY_KEY
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        key = SigningKey.generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key.private_text() + "\n")
        atomic_write(state_dir / AUTHORITY_PUB, key.public.text + "\n", mode=0o600)
        log.info("created the federation's authority key in %s (it certifies devices; keep it here)", path)
        return key
    except OSError as exc:
        raise BrokerConfigError(f"{path}: unreadable authority key ({exc})") from exc
    try:
        key = SigningKey.from_text(text)
    except (SignatureError, ValueError) as exc:
        raise BrokerConfigError(f"{path}: not an Ed25519 private key ({exc})") from exc
    if authority_public(state_dir) != key.public:
        atomic_write(state_dir / AUTHORITY_PUB, key.public.text + "\n", mode=0o600)
    return key


def authority_public(state_dir: Path) -> VerifyKey | None:
    """The authority's public key (None: no authority in this folder yet)."""
    try:
        return VerifyKey.from_text((state_dir / AUTHORITY_PUB).read_text().strip(), "authority public key")
    except FileNotFoundError:
        return None
    except (OSError, SignatureError) as exc:
        raise BrokerConfigError(f"{state_dir / AUTHORITY_PUB}: {exc}") from exc


def _cert_path(state_dir: Path, device: str) -> Path:
    return state_dir / CERTS_DIR / f"{device}.json"


def current_cert(state_dir: Path, federation: str, device: str) -> DeviceCert | None:
    path = _cert_path(state_dir, device)
    pub = authority_public(state_dir)
    if pub is None or not path.exists():
        return None
    try:
        return parse_cert(path.read_text(), pub, federation)
    except (OSError, SignatureError) as exc:
        raise BrokerConfigError(f"{path}: unreadable certificate ({exc})") from exc


def read_revocations(state_dir: Path, federation: str) -> Revocations | None:
    path = state_dir / REVOCATION_LIST
    pub = authority_public(state_dir)
    if pub is None or not path.exists():
        return None
    try:
        return parse_revocations(path.read_text(), pub, federation)
    except (OSError, SignatureError) as exc:
        raise BrokerConfigError(f"{path}: unreadable revocation list ({exc})") from exc


def revoke_serial(state_dir: Path, federation: str, device: str, serial: int) -> Revocations:
    """Put certificate ``serial`` of ``device`` on the revocation list (a new, higher version)."""
    authority = ensure_authority(state_dir)
    old = read_revocations(state_dir, federation)
    entries = set(old.entries if old else ()) | {(device, str(serial))}
    version = (old.version if old else 0) + 1
    revs = sign_revocations(authority, federation, version, int(time.time()), entries)
    atomic_write(state_dir / REVOCATION_LIST, revs.to_text(), mode=0o600)
    log.info("revocation list version %d: certificate %d of %s revoked", version, serial, device)
    return revs


def certify(state_dir: Path, federation: str, device: str, key: VerifyKey) -> DeviceCert:
    """``device``'s certificate for ``key``: the current one when it certifies that key, else a new one with the
    next serial (the one it replaces goes on the revocation list)."""
    authority = ensure_authority(state_dir)
    old = current_cert(state_dir, federation, device)
    if old is not None and old.key == key:
        return old
    cert = issue_cert(authority, federation, device, key, (old.serial if old else 0) + 1, int(time.time()))
    private_dir(state_dir / CERTS_DIR)
    atomic_write(_cert_path(state_dir, device), cert.to_text() + "\n", mode=0o600)
    if old is not None:
        revoked = read_revocations(state_dir, federation)
        if revoked is None or not revoked.revokes(device, old.serial):
            revoke_serial(state_dir, federation, device, old.serial)
    log.info("certificate %d of %s issued", cert.serial, device)
    return cert
