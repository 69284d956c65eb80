"""Devices revoked by ``flayer broker revoke``: the broker's ``revoked.json`` (device id -> unix time).

The broker shuts a revoked device out (password gone, live connection closed); the coordinator
reads the same list so that it stops selecting the device and drops whatever it sent from then on
(a message already queued at the broker, a retained status). The file is read again when its
modification time changes, at most every ``min_interval_s``; ``on_new``, when set, is told the devices each
reading adds (the open round then stops waiting for them: :meth:`coordinator.messages_in.MessageIntake.withdraw`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["MAX_REVOKED", "RevocationList"]

log = logging.getLogger(__name__)
MAX_REVOKED = 100_000
MAX_FILE_BYTES = 8 << 20


class RevocationList:
    def __init__(self, path: Path | None, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.min_interval_s, self.clock = path, min_interval_s, clock
        self.revoked: frozenset[str] = frozenset()
        self._mtime: float | None = None
        self._checked = -float("inf")
        self.on_new: Callable[[frozenset[str]], None] | None = None  # told the devices a later reading adds
        self.refresh(force=True)

    def __contains__(self, client: object) -> bool:
        return client in self.revoked

    def refresh(self, force: bool = False) -> frozenset[str]:
        """Re-read the file when it changed; a malformed file keeps the last good list (logged)."""
        now = self.clock()
        if self.path is None or (not force and now - self._checked < self.min_interval_s):
            return self.revoked
        self._checked = now
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self.revoked
        if st.st_mtime == self._mtime:
            return self.revoked
        try:
            if st.st_size > MAX_FILE_BYTES:
                raise ValueError(f"{st.st_size} bytes (at most {MAX_FILE_BYTES})")
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or len(data) > MAX_REVOKED or not all(isinstance(k, str) for k in data):
                raise ValueError("expected a JSON object of device ids")
        except (OSError, ValueError) as exc:
            log.error("revocation list %s unreadable (%s); keeping %d revoked device(s)", self.path, exc,
                      len(self.revoked))
            return self.revoked
        new = frozenset(data) - self.revoked
        if new:
            log.warning("revoked: %s (no longer selected; their messages are dropped)", ", ".join(sorted(new)))
        self.revoked = frozenset(data)
        self._mtime = st.st_mtime
        if new and self.on_new is not None:
            self.on_new(new)
        return self.revoked
