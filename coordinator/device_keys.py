"""What the coordinator believes: each device's public signing key, from the broker's ``signing_keys.json``.

``flayer broker start`` / ``add-device`` write the file beside the credentials (:mod:`mqtt_broker.keys`);
the coordinator reads it again when its modification time changes (at most every ``min_interval_s``), so a
device added, re-keyed or revoked while a federation runs is believed, or refused, from then on. A message
is believed only when the key registered for its sender signed it (:class:`protocol.Trust`); a revoked
device's key is refused even while the file still lists it. A malformed file keeps the last good keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

from protocol import SignatureError, VerifyKey
from protocol.signing import parse_key_registry

__all__ = ["DeviceKeys"]

log = logging.getLogger(__name__)
MAX_FILE_BYTES = 32 << 20


class DeviceKeys:
    """The coordinator's :class:`protocol.Trust`: one federation, the devices' keys from ``path``."""

    def __init__(self, federation: str, path: Path | None, revoked: Callable[[], Collection[str]] = frozenset,
                 min_interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.federation, self.path, self.revoked = federation, path, revoked
        self.min_interval_s, self.clock = min_interval_s, clock
        self.keys: dict[str, VerifyKey] = {}
        self._mtime: float | None = None
        self._checked = -float("inf")
        self.refresh(force=True)
        if path is not None and not path.exists():
            log.error("no device keys at %s: every device's message is refused until 'flayer broker start' or "
                      "'add-device' writes them", path)

    def refresh(self, force: bool = False) -> dict[str, VerifyKey]:
        now = self.clock()
        if self.path is None or (not force and now - self._checked < self.min_interval_s):
            return self.keys
        self._checked = now
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self.keys
        if st.st_mtime == self._mtime:
            return self.keys
        try:
            if st.st_size > MAX_FILE_BYTES:
                raise SignatureError(f"{st.st_size} bytes (at most {MAX_FILE_BYTES})")
            _, keys = parse_key_registry(self.path.read_text(), str(self.path))
        except (OSError, UnicodeDecodeError, SignatureError) as exc:
            log.error("device keys %s unreadable (%s); keeping the %d known", self.path, exc, len(self.keys))
            return self.keys
        changed = sorted(d for d in set(keys) | set(self.keys) if keys.get(d) != self.keys.get(d))
        if self._mtime is not None and changed:
            log.warning("device keys changed (%s): what the old keys sign is refused from now on",
                        ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else ""))
        self.keys, self._mtime = keys, st.st_mtime
        return self.keys

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        if federation != self.federation:
            raise SignatureError(f"signed for federation {federation!r}, not {self.federation!r}")
        if sender in self.revoked():
            raise SignatureError(f"{sender!r} is revoked: its key is refused")
        key = self.refresh().get(sender)
        if key is None:
            raise SignatureError(f"no key registered for {sender!r} (not a device of this federation, or revoked)")
        return key
