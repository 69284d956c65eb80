"""Training slots of an asynchronous federation (``mode = "async"``, :mod:`flayer.engine.versions`).

At most ``concurrency`` devices (0: every device online) hold a slot; the round plan's ``selected``
lists them, and a device trains when it holds one, on the newest model version it has. A slot is
freed when its holder's update is answered (accepted or refused) and after ``deadline_s`` without an
answer (the device may still deliver within ``max_staleness``: it was offered that version). Free
slots go to idle devices online, drawn by :func:`flayer.engine.assign_slots` -- never to a device
whose update from the current version is already folded.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from flayer.engine import AsyncSettings, assign_slots

__all__ = ["Slots"]


class Slots:
    def __init__(self, settings: AsyncSettings, seed: int, hold_s: float) -> None:
        self.settings, self.seed, self.hold_s = settings, seed, hold_s
        self.held: dict[str, float] = {}  # device -> when it got its slot
        self.given = 0  # slots handed out in the current version (keeps the seeded draws apart)
        self.version = 0

    def release(self, client: str) -> bool:
        return self.held.pop(client, None) is not None

    def expire(self, now: float) -> list[str]:
        """Free the slots held longer than ``hold_s`` without an answer."""
        gone = [c for c, since in self.held.items() if now - since >= self.hold_s]
        for c in gone:
            del self.held[c]
        return gone

    def drop_offline(self, online: Collection[str]) -> list[str]:
        """Free the slots of devices no longer online (revoked, or gone past ``stale_after_s``)."""
        gone = [c for c in self.held if c not in online]
        for c in gone:
            del self.held[c]
        return gone

    def fill(self, online: Sequence[str], folded: Collection[str], version: int, now: float) -> list[str]:
        """Give the free slots to idle devices online; returns the new holders."""
        if version != self.version:
            self.version, self.given = version, 0
        cap = self.settings.concurrency or len(set(online))
        idle = [c for c in online if c not in self.held and c not in folded]
        new = assign_slots(idle, cap - len(self.held), self.seed, version, self.given)
        self.given += len(new)
        for c in new:
            self.held[c] = now
        return new
