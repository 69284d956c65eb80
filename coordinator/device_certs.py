"""What the coordinator checks device certificates against: the federation authority's public key and its signed
revocation list, from the broker's state folder (:mod:`mqtt_broker.authority`: ``authority.pub``,
``revocation_list.json``, ``certs/<device>.json``; the coordinator never holds the authority's private key).

Each secure round gets a :class:`protocol.certs.RoundCerts` over them (:meth:`DeviceCerts.for_round`): every key
advert must carry a certificate of its sender that the authority signed, for this federation, not revoked by the
current list, whose key signed the advert -- else the advert is refused and its sender named
(:mod:`flayer.secagg.signed_adverts`). A broker folder without an authority (an emulated fleet, a federation made
before certificates) keeps the key registry (:mod:`coordinator.device_keys`). The files are read again when their
modification time changes (at most every ``min_interval_s``); an unreadable or unsigned list keeps the last good one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from mqtt_broker.authority import AUTHORITY_PUB, REVOCATION_LIST
from protocol import SignatureError, Trust, VerifyKey
from protocol.certs import MAX_CERT_BYTES, Revocations, RoundCerts, parse_revocations
from protocol.topics import TopicError, validate_id

__all__ = ["DeviceCerts"]

log = logging.getLogger(__name__)
CERTS_DIR = "certs"
MAX_LIST_BYTES = 8 << 20


class DeviceCerts:
    """The authority's public key and revocation list of one federation, from broker folder ``folder``."""

    def __init__(self, federation: str, folder: Path | None, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.federation, self.folder, self.min_interval_s, self.clock = federation, folder, min_interval_s, clock
        self.authority: VerifyKey | None = None
        self._revocations: Revocations | None = None
        self._mtimes: tuple[float | None, float | None] = (None, None)
        self._checked = -float("inf")
        self.refresh(force=True)

    def _mtime(self, name: str) -> float | None:
        try:
            return (self.folder / name).stat().st_mtime if self.folder is not None else None
        except OSError:
            return None

    def refresh(self, force: bool = False) -> None:
        now = self.clock()
        if self.folder is None or (not force and now - self._checked < self.min_interval_s):
            return
        self._checked = now
        mtimes = (self._mtime(AUTHORITY_PUB), self._mtime(REVOCATION_LIST))
        if mtimes == self._mtimes:
            return
        try:
            if mtimes[0] is not None:
                self.authority = VerifyKey.from_text((self.folder / AUTHORITY_PUB).read_text().strip(),
                                                     "authority public key")
            if mtimes[1] is not None and self.authority is not None:
                raw = (self.folder / REVOCATION_LIST).read_bytes()
                if len(raw) > MAX_LIST_BYTES:
                    raise SignatureError(f"{len(raw)} bytes (at most {MAX_LIST_BYTES})")
                revs = parse_revocations(raw, self.authority, self.federation)
                if self._revocations is None or revs.version >= self._revocations.version:
                    self._revocations = revs
        except (OSError, UnicodeDecodeError, SignatureError) as exc:
            log.error("authority files in %s unreadable (%s); keeping the last good ones", self.folder, exc)
            return
        self._mtimes = mtimes

    def revocations(self) -> Revocations | None:
        self.refresh()
        return self._revocations

    def lookup(self, device: str) -> bytes | None:
        """``device``'s current certificate as the admin's tooling filed it (a signer whose advert never came)."""
        try:
            validate_id(device, "device id")
            assert self.folder is not None
            path = self.folder / CERTS_DIR / f"{device}.json"
            if path.stat().st_size > MAX_CERT_BYTES:
                return None
            return path.read_bytes()
        except (OSError, TopicError, AssertionError):
            return None

    def for_round(self, registry: Trust | None = None) -> RoundCerts | None:
        """A round's certificate checker (None: no authority in the broker folder, the key registry decides). With
        ``registry``, a device the authority never certified (no ``certs/<device>.json``: its credentials were made
        in the broker folder, with no kit) is checked against the key registry, as before certificates."""
        self.refresh()
        if self.authority is None:
            return None
        if registry is None:
            return RoundCerts(self.federation, self.authority, self.revocations, self.lookup)
        return UncertifiedByRegistry(self.federation, self.authority, self.revocations, self.lookup, registry)


class UncertifiedByRegistry(RoundCerts):
    """A round's certificates, and the key registry for the devices the authority never certified: a device whose
    certificate the admin's tooling filed (it was given a kit) must carry it in its advert, one with none filed
    (an emulated fleet, devices on the broker's machine) is believed under its registry key. A kit device checks
    only certificates, so it refuses a round holding an uncertified neighbour: give every device of a federation
    that mixes them a kit (docs/explanation/security.md)."""

    def __init__(self, federation: str, authority: VerifyKey, revocations: Callable[[], Revocations | None],
                 lookup: Callable[[str], bytes | None], registry: Trust) -> None:
        super().__init__(federation, authority, revocations, lookup)
        self.registry = registry
        self._filed: dict[str, bool] = {}

    def _uncertified(self, device: str) -> bool:
        if device not in self._filed:
            self._filed[device] = self.lookup is not None and bool(self.lookup(device))
        return not self._filed[device]

    def admit(self, device: str, raw: bytes) -> str | None:
        if not raw and self._uncertified(device):
            return None  # its key is the registry's (key_for)
        return super().admit(device, raw)

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        if self._uncertified(sender):
            return self.registry.key_for(federation, sender)
        return super().key_for(federation, sender)
