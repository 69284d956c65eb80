"""Asynchronous buffered rounds (in the spirit of FedBuff), and the screen every update meets first.

In ``mode = "async"`` devices train whenever they hold a training slot, on the newest model they
have. The coordinator publishes model version ``v`` (its plan has ``round = v``) and folds every
update that arrives into the buffer of version ``v``, whatever version it was trained from
(``u <= v``); when ``buffer`` updates are in, the buffer's aggregate becomes version ``v + 1`` and
is published. An update's staleness is ``v - u``: beyond ``max_staleness`` it is refused (counter
``stale``), otherwise its deltas are weighted by the staleness rule (:mod:`.gate`). At most
``concurrency`` devices hold a slot at once (0: every device online); a slot is freed when its
holder's update is accepted, after ``deadline_s`` without one, or when it goes offline (a refusal
frees nothing: junk cannot churn the slots).

One update per device per buffer: a device whose update is already folded into the buffer of the
current version is refused (ack ``late``, counter ``in_buffer``) whatever version its next one was
trained from, so one device offered many versions cannot fill a buffer with updates trained from
each. Synchronous rounds are the special case ``max_staleness = 0`` with one plan per version: the
same :func:`screen` decides both from the (device, base version) pair alone, before anything is
decoded.

Derived defaults (``"auto"``, :func:`resolve_async`, resolved once when a run starts, logged and
recorded):

- ``concurrency = ceil(over_selection x buffer)``: as many devices train at once as a synchronous
  round of quorum ``buffer`` would select (11 for the demo's buffer 8 and over-selection 1.3);
- ``max_staleness = ceil(SLOW_FACTOR x C / buffer)`` with C the concurrency in force (the fleet's
  size when it is 0, every device, and the fleet is known; else auto's C): C devices whose updates
  take the median time T each produce a version every ``buffer x T / C``, so a device ``k`` times
  slower than the median lands ``k x C / buffer`` versions after it started; ``SLOW_FACTOR`` = 24
  keeps devices up to 24 times slower than the median (33 for the demo fleet, whose field sensors
  are about 10 times slower and spend minutes offline mid-upload). A large bound costs little: a
  stale update's deltas are weighted down (``staleness``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Literal

from .gate import STALENESS_RULES, Verdict, refuse

ASYNC_AIM_VERSIONS = 2  # asynchronous: a device's upload aims to land by the close of the version after its own

__all__ = ["AUTO", "SLOW_FACTOR", "AsyncSettings", "VersionWindow", "expected_close", "resolve_async", "screen"]

AUTO: Literal["auto"] = "auto"  # a setting derived from the others and the fleet (resolve_async)
SLOW_FACTOR = 24  # max_staleness = "auto" keeps devices this many times slower than the median


@dataclass(frozen=True)
class AsyncSettings:
    buffer: int = 8  # accepted updates per new model version
    max_staleness: int = 8  # versions an update may lag the current one
    staleness: str = "sqrt"  # 1/sqrt(1+s); inverse: 1/(1+s); constant: 1
    concurrency: int = 0  # devices training at once (0: every device online)

    def __post_init__(self) -> None:
        if not 1 <= self.buffer <= 100_000:
            raise ValueError(f"buffer must be in [1, 100000], got {self.buffer}")
        if not 0 <= self.max_staleness <= 1000:
            raise ValueError(f"max_staleness must be in [0, 1000], got {self.max_staleness}")
        if self.staleness not in STALENESS_RULES:
            raise ValueError(f"staleness must be one of {', '.join(STALENESS_RULES)}, got {self.staleness!r}")
        if not 0 <= self.concurrency <= 1_000_000:
            raise ValueError(f"concurrency must be in [0, 1000000] (0: no bound), got {self.concurrency}")


def resolve_async(buffer: int, max_staleness: int | str, staleness: str, concurrency: int | str,
                  over_selection: float, fleet: int | None = None) -> tuple[AsyncSettings, dict[str, str]]:
    """The settings in force, ``"auto"`` values derived (module docstring), and how each derived one
    was computed (setting -> formula with its numbers; empty when every value was explicit).
    ``fleet``: the number of devices, when the driver knows it (the emulators); None for the coordinator."""
    how: dict[str, str] = {}
    if concurrency == AUTO:
        concurrency = max(1, math.ceil(over_selection * buffer - 1e-9))
        how["concurrency"] = f"ceil(over_selection {over_selection:g} x buffer {buffer}) = {concurrency}"
    if not isinstance(concurrency, int) or isinstance(concurrency, bool):
        raise TypeError(f"concurrency must be an integer or {AUTO!r}, got {concurrency!r}")
    if max_staleness == AUTO:
        c = concurrency or fleet or max(1, math.ceil(over_selection * buffer - 1e-9))
        if fleet:
            c = min(c, fleet)
        max_staleness = min(1000, max(1, math.ceil(SLOW_FACTOR * c / buffer - 1e-9)))
        how["max_staleness"] = f"ceil({SLOW_FACTOR} x concurrency {c} / buffer {buffer}) = {max_staleness}"
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool):
        raise TypeError(f"max_staleness must be an integer or {AUTO!r}, got {max_staleness!r}")
    return AsyncSettings(buffer, max_staleness, staleness, concurrency), how


def screen(client: str, base: int, current: int | None, done: int, offered: Mapping[int, AbstractSet[str]],
           folded: Mapping[int, AbstractSet[str]], max_staleness: int = 0,
           buffered: AbstractSet[str] = frozenset()) -> Verdict | None:
    """A verdict from the (client, base version) pair alone, or None when the blob must be decoded.

    ``current``: the version taking updates (synchronous: the open round; None between rounds);
    ``done``: the last closed round; ``offered``: who was offered each version (the plans' selections);
    ``folded``: whose update trained from each version was already folded; ``buffered``: whose update
    (from any version) is already in the current version's buffer -- at most one per device."""
    if client in folded.get(base, ()):
        return refuse("duplicate", "duplicate", f"the update of {client} for round {base} was already folded")
    if current is not None and client in buffered and base <= current:
        return refuse("late", "in_buffer", f"an update of {client} is already in the buffer of version {current} "
                                           f"(one per device per version); train on version {current + 1}")
    if current is None or base > current:
        if base <= done:
            return refuse("late", "late", f"round {base} is closed; the open round is {current or 'none yet'}")
        return refuse("rejected", "future_round", f"round {base} is not open (open round: {current or 'none'})")
    if current - base > max_staleness:
        if max_staleness == 0:
            return refuse("late", "late", f"round {base} is closed; the open round is {current}")
        return refuse("late", "stale", f"trained from version {base}, {current - base} behind the current "
                                       f"{current}; at most {max_staleness} are taken (max_staleness)")
    if client not in offered.get(base, ()):
        return refuse("not_selected", "not_selected", f"{client} is not selected for round {base}")
    return None


@dataclass
class VersionWindow:
    """The recent model versions of an asynchronous federation: their digests, who was offered each
    (a slot while it was current), whose update from each was folded, and whose update is in the
    current version's buffer (rebuilt by a replay after a restart, so not saved)."""

    max_staleness: int
    current: int = 0
    digests: dict[int, str] = field(default_factory=dict)
    offered: dict[int, set[str]] = field(default_factory=dict)
    folded: dict[int, set[str]] = field(default_factory=dict)
    buffered: set[str] = field(default_factory=set)

    def publish(self, version: int, digest: str) -> None:
        """Version ``version`` (model ``digest``) is now current; versions too old to be taken are forgotten
        (who was folded is kept a while longer, so a re-sent update is told ``duplicate``, not ``stale``)."""
        if version != self.current:
            self.buffered = set()
        self.current = version
        self.digests[version] = digest
        keep, keep_folded = version - self.max_staleness, version - 2 * self.max_staleness - 2
        self.digests = {v: d for v, d in self.digests.items() if v >= keep}
        self.offered = {v: s for v, s in self.offered.items() if v >= keep}
        self.folded = {v: s for v, s in self.folded.items() if v >= keep_folded}

    def offer(self, clients: Iterable[str]) -> None:
        self.offered.setdefault(self.current, set()).update(clients)

    def staleness(self, base: int) -> int:
        return self.current - base

    def screen(self, client: str, base: int) -> Verdict | None:
        return screen(client, base, self.current, self.current - 1, self.offered, self.folded, self.max_staleness,
                      self.buffered)

    def fold(self, client: str, base: int) -> None:
        self.folded.setdefault(base, set()).add(client)
        self.buffered.add(client)

    def as_dict(self) -> dict[str, Any]:
        return {"current": self.current, "digests": {str(k): v for k, v in self.digests.items()},
                "offered": {str(k): sorted(v) for k, v in self.offered.items()},
                "folded": {str(k): sorted(v) for k, v in self.folded.items()}}

    @classmethod
    def from_dict(cls, max_staleness: int, d: Mapping[str, Any]) -> VersionWindow:
        def sets(m: Any) -> dict[int, set[str]]:
            return {int(k): {str(c) for c in v} for k, v in dict(m or {}).items()}

        return cls(max_staleness, int(d.get("current", 0)), {int(k): str(v) for k, v in dict(d.get("digests") or {}).items()},
                   sets(d.get("offered")), sets(d.get("folded")))


def expected_close(mode: str, opened_at: float, deadline: float, durations: Sequence[float],
                   max_staleness: int, last: bool = False) -> float | None:
    """When an update of a round (version) opened at ``opened_at`` should have arrived to count: the
    plan's ``close_by``, which devices fitting their uploads to their link aim for (None: no history yet,
    the deadline stands). The coordinator and the simulated clock (``flayer emulate --virtual``) both
    take it from here.

    1. Synchronous: the earliest close of the recent rounds after the open, at most the deadline. A
       round closes ``grace_s`` after its quorum, so its length varies with who makes the quorum; aiming
       for the median would be late about every other round, the shortest recent one rarely.
    2. Asynchronous: ``ASYNC_AIM_VERSIONS`` (2) versions of the median recent length after this one opened
       (at most ``max_staleness + 1``), one in the run's ``last`` version. An update counts for
       ``max_staleness`` versions, but one aimed that far is sent whole over a thin link (fp32 of the demo's
       CNN: 14 s at 1 Mbit/s), arrives stale (weighted down) and, near the end, after the run's last version
       has closed; aimed at the next version's close it is fitted to what lands by then."""
    if not durations:
        return None
    if mode == "async":
        versions = 1 if last else min(ASYNC_AIM_VERSIONS, max_staleness + 1)
        return opened_at + statistics.median(durations) * versions
    return min(deadline, opened_at + min(durations))
