"""Round policy, as pure functions of the clock: who is selected, and when a round closes.

Selection is the engine's (:func:`flayer.engine.select_devices`, over-selection among the devices
online, seeded from (run seed, round): the same draw on a restarted coordinator).

Closing (:class:`RoundTimer`, first rule that holds):

1. every selected device was accepted, or revoked since it was selected (:meth:`RoundTimer.withdraw`: it cannot
   come) -> close now;
2. the quorum (capped at the number selected) was reached ``grace_s`` ago -> close;
3. the deadline passed with at least ``min_updates`` accepted -> close;
4. the deadline passed with fewer, and the round was not extended yet, and ``extend_s > 0`` ->
   extend the deadline once by ``extend_s`` (the plan is re-published with the new deadline);
5. the deadline passed otherwise -> close with what arrived (possibly nothing: the global model
   then stays as it was, rule ``carry``).

Announced uploads (:class:`Announcements`, ``announce_wait_s > 0``): rule 2 holds off while a selected
device that announced an upload it has started (its status ``uploading`` with ``upload_round`` and
``upload_s``, the seconds it expects the upload to take; 0 when it knows no uplink rate yet) is still
expected: until its expected finish (``upload_s`` x ``ANNOUNCE_SLACK`` + ``ANNOUNCE_EXTRA_S`` after the
announcement arrived; with 0, until the bound), and never past
``quorum + grace + announce_wait_s`` nor the deadline. One announcement per device and round counts (the
first); one from a device not selected, already in, of another round, or with a value that is not a
finite number >= 0 is ignored. A device that announces and vanishes costs the round at most
``announce_wait_s``: the close bound is the timer's, not the device's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from flayer.engine import select_devices

__all__ = ["ANNOUNCE_EXTRA_S", "ANNOUNCE_SLACK", "Announcements", "Decision", "RoundTimer", "select_devices"]

ANNOUNCE_SLACK = 1.5  # an announced upload is waited for 1.5 x the time its device expects it to take ...
ANNOUNCE_EXTRA_S = 2.0  # ... plus 2 s (latency, the broker, a rate estimate a little optimistic)


@dataclass(frozen=True)
class Decision:
    action: str  # wait | close | extend
    reason: str = ""


@dataclass
class Announcements:
    """Uploads the selected devices announced they have started in one round: client -> expected finish
    (coordinator clock). See the module docstring for what is taken."""

    round: int
    selected: Collection[str]
    finish: dict[str, float] = field(default_factory=dict)
    rounds: range | None = None  # asynchronous: the versions an announced upload may be trained on
    held_since: float | None = None  # asynchronous, the last version: when its full buffer began to wait
    wake: float | None = None  # asynchronous, the last version: when that wait ends

    def __post_init__(self) -> None:
        if self.rounds is None:
            self.rounds = range(self.round, self.round + 1)

    def add(self, client: str, info: Mapping[str, object], now: float, accepted: Collection[str]) -> str:
        """Take the announcement in a device's status ``info``; returns what was done ("" when taken)."""
        if "upload_round" not in info:
            return "no announcement"
        rnd, secs = info.get("upload_round"), info.get("upload_s")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd not in (self.rounds or ()):
            return f"announcement for round {rnd!r}, not {self.round}"
        if client not in self.selected or client in accepted:
            return "announcement from a device not selected or already in"
        if client in self.finish:
            return "announced already"
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not math.isfinite(secs) or secs < 0:
            return f"upload_s must be a finite number >= 0, got {secs!r}"
        # 0: the device knows no rate yet (its first upload): awaited up to the bound, like any long one
        self.finish[client] = now + float(secs) * ANNOUNCE_SLACK + ANNOUNCE_EXTRA_S if secs > 0 else math.inf
        return ""

    def awaited(self, now: float, accepted: Collection[str]) -> float | None:
        """The latest expected finish of the announced uploads not in yet and not overdue (None: none)."""
        due = [t for c, t in self.finish.items() if c not in accepted and t > now]
        return max(due) if due else None


@dataclass
class RoundTimer:
    opened_at: float
    deadline: float
    selected: int
    quorum: int
    grace_s: float
    min_updates: int = 1
    extend_s: float = 0.0
    quorum_at: float | None = None
    extended: bool = False
    announce_wait_s: float = 0.0  # announced uploads hold rule 2 off this long at most (Announcements)
    announced: Announcements | None = None
    arrived: Collection[str] = ()  # the devices accepted so far (announcements of those are done)
    withdrawn: set[str] = field(default_factory=set)  # selected, revoked before their update came: not waited for

    @property
    def effective_quorum(self) -> int:
        return max(1, min(self.quorum, self.selected))

    def accepted(self, count: int, now: float) -> None:
        """Call after each accepted update (``count`` = accepted so far)."""
        if self.quorum_at is None and count >= self.effective_quorum:
            self.quorum_at = now

    def withdraw(self, device: str) -> None:
        """``device``, selected, was revoked before its update came: rule 1 no longer waits for it."""
        self.withdrawn.add(device)

    def decide(self, count: int, now: float) -> Decision:
        if self.selected and count >= self.selected - len(self.withdrawn):
            return Decision("close", "every selected device reported" if not self.withdrawn else
                            f"every selected device reported but {len(self.withdrawn)} revoked")
        if self.quorum_at is not None and now >= self.quorum_at + self.grace_s:
            wait = self._announced_until(now)
            if wait is None:
                return Decision("close", f"quorum {self.effective_quorum} + grace {self.grace_s:g}s")
            if now < wait:
                return Decision("wait")
            return Decision("close", f"quorum {self.effective_quorum} + grace {self.grace_s:g}s + announced "
                                     f"upload(s) waited for (at most {self.announce_wait_s:g}s)")
        if now < self.deadline:
            return Decision("wait")
        if count >= self.min_updates:
            return Decision("close", f"deadline with {count} update(s)")
        if not self.extended and self.extend_s > 0:
            return Decision("extend", f"deadline with {count} < {self.min_updates} update(s): extended once by "
                                      f"{self.extend_s:g}s")
        return Decision("close", f"deadline with only {count} update(s)")

    def _announced_until(self, now: float) -> float | None:
        """When the wait for announced uploads ends (None: nothing announced is awaited)."""
        if self.announced is None or self.announce_wait_s <= 0 or self.quorum_at is None:
            return None
        latest = self.announced.awaited(now, self.arrived)
        if latest is None:
            return None
        return min(latest, self.quorum_at + self.grace_s + self.announce_wait_s, self.deadline)

    def extend(self) -> None:
        self.deadline += self.extend_s
        self.extended = True

    def next_wakeup(self, now: float | None = None) -> float:
        """When :meth:`decide` may change without a new update."""
        t = self.deadline
        if self.quorum_at is not None:
            close = self.quorum_at + self.grace_s
            t = min(t, close if now is None or now < close else (self._announced_until(now) or close))
        return t
