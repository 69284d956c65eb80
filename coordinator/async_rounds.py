"""Training slots of an asynchronous federation (``mode = "async"``, :mod:`flayer.engine.versions`),
and the pace of its plan changes.

Slots (:class:`Slots`):

1. At most ``concurrency`` devices (0: every device online) hold a slot; the round plan's
   ``selected`` lists them, and a device trains when it holds one, on the newest version it has.
2. A slot is freed when its holder's update is accepted, after ``deadline_s`` without an accepted
   update (the device may still deliver within ``max_staleness``: it was offered that version), and
   when its holder goes offline. A refusal frees nothing: junk cannot make the coordinator re-plan,
   and a refused device keeps its slot (it trains on the next version).
3. Free slots go to idle devices online, drawn by :func:`flayer.engine.assign_slots` -- never to a
   device whose update is already in the current version's buffer (one per device per version).
4. After a restart the holders of the journal's last plan (or the checkpoint's) hold their slots
   again (:meth:`Slots.restore`), so no more than ``concurrency`` devices train; a restored holder
   not heard from yet is not taken for offline (the registry is empty at a start) -- it keeps its
   slot until it is seen offline or the slot expires.

:class:`AsyncVersions` is the coordinator's asynchronous part: it owns the slots, the plan pacer and the
version window (:class:`flayer.engine.VersionWindow`), and decides when a version closes.

Plan changes (:class:`PlanPacer`): every change of the holders is one journal record (fsynced) and one
retained plan publication. They are coalesced -- at most one per ``PLAN_INTERVAL_S`` -- and at most
``2 x buffer + 4`` per version and ``deadline_s`` period (the period renews when a short buffer's
deadline is extended): the plan records of version ``v`` are at most
``1 + (2 x buffer + 4) x ceil(its duration / deadline_s)``. Changes beyond the budget wait for the
next period or version (the holders that remain keep training).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from flayer.engine import AsyncSettings, VersionWindow, assign_slots

from .config import FederationSettings
from .open_round import OpenRound
from .registry import DeviceRegistry

__all__ = ["PLAN_INTERVAL_S", "AsyncVersions", "PlanPacer", "Slots"]

log = logging.getLogger("coordinator.server")

PLAN_INTERVAL_S = 1.0


class Slots:
    """Who holds a training slot (module docstring, rules 1-4)."""

    def __init__(self, settings: AsyncSettings, seed: int, hold_s: float) -> None:
        self.settings, self.seed, self.hold_s = settings, seed, hold_s
        self.held: dict[str, float] = {}  # device -> when it got its slot
        self.unseen: set[str] = set()  # holders restored after a restart, not yet seen online
        self.given = 0  # slots handed out in the current version (keeps the seeded draws apart)
        self.version = 0

    def release(self, client: str) -> bool:
        """The holder's update was accepted: its slot is free."""
        self.unseen.discard(client)
        return self.held.pop(client, None) is not None

    def restore(self, holders: Iterable[str], now: float) -> None:
        """After a restart: ``holders`` (the last plan's) hold their slots again, from ``now``; at most
        ``concurrency`` of them (sorted order) when there are more."""
        ordered = sorted(set(holders))
        if self.settings.concurrency:
            ordered = ordered[:self.settings.concurrency]
        self.held = dict.fromkeys(ordered, now)
        self.unseen = set(ordered)

    def expire(self, now: float) -> list[str]:
        """Free the slots held longer than ``hold_s`` without an answer."""
        gone = [c for c, since in self.held.items() if now - since >= self.hold_s]
        for c in gone:
            del self.held[c]
            self.unseen.discard(c)
        return gone

    def drop_offline(self, online: Collection[str], offline: Collection[str] = ()) -> list[str]:
        """Free the slots of devices no longer online (revoked, or gone past ``stale_after_s``); a
        restored holder not seen yet keeps its slot unless it is in ``offline`` (seen offline)."""
        self.unseen -= set(online)
        gone = [c for c in self.held if c not in online and (c not in self.unseen or c in offline)]
        for c in gone:
            del self.held[c]
            self.unseen.discard(c)
        return gone

    def fill(self, online: Sequence[str], buffered: Collection[str], version: int, now: float) -> list[str]:
        """Give the free slots to idle devices online (none to a device in ``buffered``: its update is in the
        current version's buffer); returns the new holders."""
        if version != self.version:
            self.version, self.given = version, 0
        cap = self.settings.concurrency or len(set(online))
        idle = [c for c in online if c not in self.held and c not in buffered]
        new = assign_slots(idle, cap - len(self.held), self.seed, version, self.given)
        self.given += len(new)
        for c in new:
            self.held[c] = now
        return new


class PlanPacer:
    """How often an asynchronous version's plan may change (module docstring): at most one change per
    ``interval_s``, and ``budget`` changes per version and deadline period."""

    def __init__(self, buffer: int, interval_s: float = PLAN_INTERVAL_S) -> None:
        self.budget = 2 * buffer + 4
        self.interval_s = interval_s
        self.version = 0
        self.left = self.budget
        self.last = float("-inf")

    def opened(self, version: int, now: float) -> None:
        """Version ``version``'s first plan went out (journaled and published)."""
        self.version, self.left, self.last = version, self.budget, now

    def renew(self) -> None:
        """A new deadline period of the same version (its buffer was still short): a fresh budget."""
        self.left = self.budget

    def may(self, now: float) -> bool:
        return self.left > 0 and now - self.last >= self.interval_s

    def changed(self, now: float) -> None:
        self.left -= 1
        self.last = now


class AsyncVersions:
    """The coordinator's buffer of one version: slots, plan changes, when to publish (module docstring). It
    owns the slots, the plan pacer and the version window; it is handed the open round with each call, and
    returns the reason a version closes with (the caller closes it)."""

    def __init__(self, settings: AsyncSettings, fs: FederationSettings, rounds: int, seed: int,
                 registry: DeviceRegistry, online: Callable[[float], list[str]]) -> None:
        self.fs, self.rounds, self.registry, self.online = fs, rounds, registry, online
        self.slots = Slots(settings, seed, fs.deadline_s)  # a refusal frees no slot
        self.pacer = PlanPacer(fs.buffer)
        self.window = VersionWindow(fs.staleness_bound)

    def restore_window(self, raw: Mapping[str, Any]) -> None:
        """The checkpoint's version window (ValueError, TypeError or AttributeError: unreadable)."""
        self.window = VersionWindow.from_dict(self.fs.staleness_bound, raw)

    def restore_slots(self, holders: Iterable[str], found: bool, now: float) -> None:
        """Rule 4 after a restart: ``holders`` hold their slots again, none whose update is in the buffer
        (``found``: the journal gave the version's buffered updates)."""
        in_buffer = self.window.buffered if found else set()
        self.slots.restore((str(c) for c in holders if str(c) not in in_buffer), now)
        log.info("slots restored after the restart: %s", sorted(self.slots.held))

    def begin(self, number: int, digest: str, selected: Iterable[str]) -> dict[int, str]:
        """Version ``number`` opens with model ``digest``: the model digests updates may be trained from."""
        self.window.publish(number, digest)
        self.window.offer(selected)
        return dict(self.window.digests)

    def first(self, online: list[str], number: int, now: float) -> list[str]:
        """The holders of version ``number``'s first plan."""
        self.slots.drop_offline(online, self.heard_offline(online))
        self.slots.fill(online, (), number, now)
        return sorted(self.slots.held)

    def accepted(self, client: str) -> None:
        self.slots.release(client)  # a tick soon gives the slot to an idle device

    def announcing(self, rnd: OpenRound) -> None:
        """Who may announce an upload the version waits for: any slot holder, for a version still young enough
        (waited for at the last version)."""
        assert rnd.timer is not None and rnd.timer.announced is not None
        rnd.timer.announced.selected = frozenset(self.slots.held) | rnd.selected
        rnd.timer.announced.rounds = range(max(1, rnd.number - self.fs.staleness_bound), rnd.number + 1)

    def heard_offline(self, online: list[str]) -> set[str]:
        """Restored slot holders (rule 4) the registry has heard from that are not online: their slots may go."""
        return {c for c in self.slots.unseen if self.registry.get(c) is not None} - set(online)

    def tick(self, rnd: OpenRound, now: float, replan: Callable[[], None]) -> str | None:
        """The buffer of version ``rnd.number``: keep the slots filled, publish at ``buffer`` updates. The
        holders change -- one journal record and one plan publication (``replan``) -- only as
        :class:`PlanPacer` allows. Returns the reason the version closes with (None: it stays open)."""
        assert rnd.timer is not None and rnd.journal is not None
        if self.pacer.may(now):
            online = self.online(now)
            self.slots.expire(now)
            self.slots.drop_offline(online, self.heard_offline(online))
            new = self.slots.fill(online, self.window.buffered, rnd.number, now)
            held = frozenset(self.slots.held)
            if held != rnd.selected:
                self.window.offer(new)
                rnd.selected = held
                rnd.stats.selected = sorted(set(rnd.stats.selected) | held)
                replan()
                self.pacer.changed(now)
        accepted = rnd.aggregate.tally.accepted
        if accepted >= self.fs.buffer and self._last_awaits(rnd, now):
            return None
        if accepted >= self.fs.buffer:
            return f"buffer of {self.fs.buffer} update(s) full"
        if now >= rnd.timer.deadline:
            if accepted >= self.fs.min_updates:
                return f"deadline with {accepted} of {self.fs.buffer} update(s)"
            rnd.timer.deadline = now + self.fs.deadline_s  # nothing to publish yet: keep buffering
            self.pacer.renew()
        return None

    def _last_awaits(self, rnd: OpenRound, now: float) -> bool:
        """The last version waits, past a full buffer, for uploads devices announced (at most
        ``announce_wait_s`` after the buffer filled): what the slowest had in flight counts, not cut off by
        the end of the run (earlier versions need not: such an upload goes into the next buffer)."""
        assert rnd.timer is not None
        a = rnd.timer.announced
        if rnd.number < self.rounds or a is None or self.fs.announce_wait_s <= 0:
            return False
        if a.held_since is None:
            a.held_since = now  # the buffer filled now: the bound runs from here
        until = a.awaited(now, rnd.accepted)
        if until is None or now >= a.held_since + self.fs.announce_wait_s:
            return False
        a.wake = min(until, a.held_since + self.fs.announce_wait_s)
        return now < a.wake

    def record(self) -> dict[str, Any]:
        """The checkpoint's version window, with the slot holders (restored after a restart, rule 4)."""
        return {**self.window.as_dict(), "slots": sorted(self.slots.held)}
