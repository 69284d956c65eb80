"""The other devices' keys, as the federation's authority certified them (:mod:`protocol.certs`).

A device started from a kit pins the authority's public key (``authority.pub``) and holds its own certificate
(``device.cert``), which it carries in each of its key adverts (:mod:`flayer.secagg.signed_adverts`); nothing is
published on, or read from, a certificate topic. A neighbour's key adverts and survivor signatures
(:mod:`flayer.secagg.consistency`) are checked against the key of the certificate that round's key bundle (or unmask
request) carried for it (:func:`round_keys`): one the pinned authority signed, of this federation and that device,
and not on the newest revocation list held. No file is copied between devices: a device added later is believed
from its first advert; a re-keyed device's new certificate is believed, its old one is on the revocation list.

The revocation list arrives retained on ``revocations`` (only the admin user may publish there; it is signed, so any
relay would do) and with each kit. The device keeps the highest version it has seen in its state folder
(``revocations.json``), refuses a lower one (a rollback that would make a revoked key believed again), and refuses
any certificate the list revokes. A coordinator holds no authority key, so it can mint no certificate: a device it
invents is refused, and so is the round whose key bundle names it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol import SignatureError, VerifyKey
from protocol.certs import Revocations, RoundCerts, parse_cert, parse_revocations

__all__ = ["REVOCATIONS_FILE", "CertifiedKeys", "round_keys"]

log = logging.getLogger(__name__)
REVOCATIONS_FILE = "revocations.json"


class CertifiedKeys:
    """The pinned ``authority``, this device's own certificate (``own``, carried in its adverts) and the highest
    revocation list seen (kept in ``state_dir``): what each secure round's :class:`protocol.certs.RoundCerts` checks
    the certificates its messages carry with (:func:`round_keys`)."""

    def __init__(self, federation: str, authority: VerifyKey, state_dir: Path, own: str | bytes,
                 kit_revocations: bytes | None = None) -> None:
        self.federation, self.authority, self.state_dir = federation, authority, Path(state_dir)
        self._lock = threading.Lock()
        self.revocations: Revocations | None = None
        self.own = parse_cert(own, authority, federation)  # SignatureError: a kit whose certificate is not its own
        stored = self.state_dir / REVOCATIONS_FILE
        if stored.is_file():
            try:
                self.revocations = parse_revocations(stored.read_bytes(), authority, federation)
            except (OSError, SignatureError) as exc:
                log.error("stored revocation list %s unreadable (%s): waiting for the authority's", stored, exc)
        if kit_revocations:
            self.offer_revocations(kit_revocations)
        if self.revocations is not None and self.revocations.revokes(self.own.device, self.own.serial):
            log.error("this device's own certificate (serial %d) is revoked: ask the admin for a new kit",
                      self.own.serial)

    # ---- what arrives -----------------------------------------------------------------------------
    def offer_revocations(self, payload: str | bytes) -> Revocations | None:
        """A revocation list: kept (and stored) when the authority signed it and its version is higher than any seen;
        a lower version is refused (a rollback), an equal one changes nothing. None when refused."""
        try:
            revs = parse_revocations(payload, self.authority, self.federation)
        except SignatureError as exc:
            log.warning("refused a revocation list: %s", exc)
            return None
        with self._lock:
            held = self.revocations
            if held is not None and revs.version < held.version:
                log.warning("refused revocation list version %d: version %d is held (a rollback)", revs.version,
                            held.version)
                return None
            if held is not None and revs.version == held.version:
                return held
            self.revocations = revs
            self._store(revs)
        return revs

    def _store(self, revs: Revocations) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / REVOCATIONS_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(revs.to_text())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    # ---- what the secure round asks -------------------------------------------------------------
    def available(self) -> bool:
        """Always: the authority's key is pinned (the neighbours' certificates are checked as they are needed)."""
        return True


def round_keys(peers: Any) -> tuple[Any, bytes, Callable[[str, bytes], str | None] | None]:
    """What one secure round checks the others' signatures with, the certificate this device carries in its advert,
    and the check of each certificate the round's messages carry: a fresh :class:`protocol.certs.RoundCerts` over
    the pinned authority and the newest revocation list held, for a device with a certificate; the registry
    (``peers``, nothing carried, nothing to check) for one without."""
    if not isinstance(peers, CertifiedKeys):
        return peers, b"", None
    keys = RoundCerts(peers.federation, peers.authority, lambda: peers.revocations)
    return keys, peers.own.to_text().encode(), keys.admit
