"""The federation's certificate revocation list: ``<state>/tls/crl.pem``, signed by the federation's CA.

Mosquitto's TLS listener names it (``crlfile``) whenever client certificates are required, so a certificate
on it fails the TLS handshake: no CONNECT, no client id taken over. Mosquitto 2.0 rebuilds the listener's
TLS context, CRL included, on every reload (SIGHUP) when a ``crlfile`` is set and certificates are required;
connections already open are not checked again (:mod:`mqtt_broker.evict` closes them).

A certificate goes on the list when the device is revoked (:func:`mqtt_broker.kit.revoke_device`) and when
it is re-issued (``add-device --rotate``: :func:`mqtt_broker.tls.make_client_cert`), so a copied old kit
cannot connect again. Its next update is set ten years ahead, and every ``flayer broker start`` signs it again:
OpenSSL refuses every client once a CRL's next update has passed.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from flayer.files import exclusive

__all__ = ["CrlError", "crl_path", "ensure_crl", "load_ca", "revoke_certificate", "revoke_serials", "revoked_serials"]

log = logging.getLogger(__name__)

CRL_NAME = "crl.pem"
NEXT_UPDATE = dt.timedelta(days=3650)
BACKDATE = dt.timedelta(minutes=5)  # a broker whose clock is a little behind still takes the list as valid


class CrlError(RuntimeError):
    """The CA or the revocation list could not be read, or the list is not the CA's."""


def crl_path(tls_dir: Path) -> Path:
    return Path(tls_dir) / CRL_NAME


def load_ca(tls_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The federation CA's certificate and key (``ca.crt``, ``ca.key``)."""
    cert_file, key_file = Path(tls_dir) / "ca.crt", Path(tls_dir) / "ca.key"
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise CrlError(f"cannot read the federation CA in {tls_dir}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CrlError(f"{key_file}: the CA key is not an EC key")
    return cert, key


def revoked_serials(tls_dir: Path) -> dict[int, dt.datetime]:
    """Serial -> revocation time of every certificate on the list (empty when there is no list yet);
    a list not signed by the federation's CA is refused."""
    path = crl_path(tls_dir)
    if not path.exists():
        return {}
    ca, _ = load_ca(tls_dir)
    try:
        crl = x509.load_pem_x509_crl(path.read_bytes())
        ok = crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    except (OSError, ValueError, InvalidSignature) as exc:
        raise CrlError(f"{path}: unreadable revocation list ({exc})") from exc
    if not ok:
        raise CrlError(f"{path}: the revocation list is not signed by the federation's CA")
    return {r.serial_number: r.revocation_date_utc for r in crl}


def _write(tls_dir: Path, entries: dict[int, dt.datetime]) -> Path:
    ca, key = load_ca(tls_dir)
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
               .last_update(now - BACKDATE).next_update(now + NEXT_UPDATE))
    for serial, when in sorted(entries.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    pem = builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    path = crl_path(tls_dir)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".crl.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # public, like the certificates
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    count = _count_file(tls_dir)
    count.write_text(f"{len(entries)}\n")
    os.chmod(count, 0o600)
    return path


def _list_lock(tls_dir: Path) -> Any:
    """One writer of the list at a time, across processes: a read-modify-write of two ``revoke`` runs at once
    would otherwise drop one's entry (and let that device's kit connect again)."""
    return exclusive(tls_dir / ".crl.lock")


def _count_file(tls_dir: Path) -> Path:
    return tls_dir / "crl.count"  # how many certificates the list held when it was last written


def ensure_crl(tls_dir: Path) -> Path:
    """The list, created empty when it never existed (the listener needs one as soon as it names it), else signed
    again with the same entries (a new next update at every start; a foreign or broken list is refused here,
    not at the broker's handshakes). A list that is missing, or holds fewer certificates than it did when last
    written (a file deleted, or restored from an older backup), is refused: an empty or shorter list would let
    revoked kits connect again."""
    with _list_lock(tls_dir):
        entries = revoked_serials(tls_dir)
        count = _count_file(tls_dir)
        if count.exists():
            try:
                held = int(count.read_text().strip() or 0)
            except ValueError:
                held = 0
            if len(entries) < held:
                raise CrlError(f"{crl_path(tls_dir)} holds {len(entries)} revoked certificate(s) where it last held "
                               f"{held} (missing, or restored from an older copy): revoked kits would connect again; "
                               f"restore the current list")
        return _write(tls_dir, entries)


def revoke_serials(tls_dir: Path, serials: Iterable[int]) -> bool:
    """Put ``serials`` on the list (re-signed); False when all were on it already."""
    with _list_lock(tls_dir):
        entries = revoked_serials(tls_dir)
        now = dt.datetime.now(dt.timezone.utc)
        new = [s for s in serials if s not in entries]
        if not new and crl_path(tls_dir).exists():
            return False
        entries.update((s, now) for s in new)
        _write(tls_dir, entries)
    log.info("revocation list: %d certificate(s) added, %d in all", len(new), len(entries))
    return bool(new)


def revoke_certificate(tls_dir: Path, cert_file: Path) -> bool:
    """Put the certificate in ``cert_file`` on the list (before the file is removed or replaced); False when
    there is no such file or the certificate was on the list already."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        raise CrlError(f"{cert_file}: unreadable certificate ({exc})") from exc
    return revoke_serials(tls_dir, [cert.serial_number])
