"""The other devices' public keys: through certificates (:mod:`edge_client.certified_keys`) when the device's
kit carries one, else (a kit of an earlier release, a device on the broker's machine, the emulator) the key registry
``signing_keys.json`` as the federation's admin wrote it (:func:`peer_keys_for` picks).

A device checks the signatures of a secure round's consistency round (each survivor signs the survivor set it
was shown, :mod:`flayer.secagg.consistency`) against these keys, never against keys the coordinator relays: a
coordinator that could hand out keys could sign for anyone. The registry comes with the device's kit (a copy
beside ``credentials.toml``, made when the kit was) or is read in place from the broker's state folder above the
credentials (a device on the broker's machine, the emulator); it is read again at a look-up when its modification
time changed, so devices added since are believed from then on, and a device revoked or re-keyed since is not. The same registry checks the key adverts the coordinator
relays (:mod:`flayer.secagg.signed_adverts`): a neighbour it does not know makes the device refuse that round. No
registry: the device takes no part in secure rounds (it would refuse every key bundle and every unmask request).
"""

from __future__ import annotations

import logging
from pathlib import Path

from protocol import SignatureError, VerifyKey
from protocol.signing import parse_key_registry
from transport.credentials import Credentials
from transport.kit import KIT_AUTHORITY, KIT_CERT, KIT_REVOCATIONS

from .certified_keys import CertifiedKeys

__all__ = ["PeerKeys", "peer_keys_for"]

log = logging.getLogger(__name__)
MAX_FILE_BYTES = 32 << 20


class PeerKeys:
    """``key_for(federation, device)`` from the registry at ``path`` (a :class:`protocol.Trust`)."""

    def __init__(self, federation: str, path: Path | None) -> None:
        self.federation, self.path = federation, path
        self.keys: dict[str, VerifyKey] = {}
        self._mtime: float | None = None
        self._missing_logged = False
        self._refresh()

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except OSError:
            if not self._missing_logged:
                log.warning("no key registry at %s: this device cannot check the other devices' signatures, so it "
                            "answers no secure round's unmask request", self.path)
                self._missing_logged = True
            return
        try:
            if st.st_mtime == self._mtime:
                return
            if st.st_size > MAX_FILE_BYTES:
                raise SignatureError(f"{st.st_size} bytes (at most {MAX_FILE_BYTES})")
            _, keys = parse_key_registry(self.path.read_text(), str(self.path))
        except (OSError, UnicodeDecodeError, SignatureError) as exc:
            log.error("key registry %s unreadable (%s); keeping the %d known", self.path, exc, len(self.keys))
            self._mtime = st.st_mtime  # read again when it changes again, not at every look-up
            return
        self.keys, self._mtime = keys, st.st_mtime

    def available(self) -> bool:
        """Whether a registry was read (without one this device takes no part in secure rounds: edge_client.secure)."""
        if not self.keys:
            self._refresh()
        return bool(self.keys)

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        if federation != self.federation:
            raise SignatureError(f"signed for federation {federation!r}, not {self.federation!r}")
        self._refresh()  # every look-up: a key revoked or replaced since is not believed (a stat when unchanged)
        key = self.keys.get(sender)
        if key is None:
            raise SignatureError(f"no key in the registry for {sender!r}")
        return key


def peer_keys_for(creds: Credentials, state_dir: Path) -> PeerKeys | CertifiedKeys:
    """Certificates when the credentials' folder holds the device's certificate and the authority's key (a kit),
    the registry otherwise. SignatureError for a kit whose certificate or authority key is not valid."""
    folder = creds.folder
    if folder is not None and (folder / KIT_CERT).is_file() and (folder / KIT_AUTHORITY).is_file():
        authority = VerifyKey.from_text((folder / KIT_AUTHORITY).read_text().strip(), "the kit's authority key")
        revs = folder / KIT_REVOCATIONS
        keys = CertifiedKeys(creds.federation, authority, state_dir, (folder / KIT_CERT).read_bytes(),
                             revs.read_bytes() if revs.is_file() else None)
        if keys.own.device != creds.username or keys.own.key != creds.signer().public:
            raise SignatureError(f"the kit's certificate is of {keys.own.device!r} (serial {keys.own.serial}), not of "
                                 f"this device's key: ask the admin for a new kit")
        return keys
    return PeerKeys(creds.federation, creds.registry)
