"""Asynchronous buffered rounds (in the spirit of FedBuff), and the screen every update meets first.

In ``mode = "async"`` devices train whenever they hold a training slot, on the newest model they
have. The coordinator publishes model version ``v`` (its plan has ``round = v``) and folds every
update that arrives into the buffer of version ``v``, whatever version it was trained from
(``u <= v``); when ``buffer`` updates are in, the buffer's aggregate becomes version ``v + 1`` and
is published. An update's staleness is ``v - u``: beyond ``max_staleness`` it is refused (counter
``stale``), otherwise its deltas are weighted by the staleness rule (:mod:`.gate`). At most
``concurrency`` devices hold a slot at once (0: every device online); a slot is freed when its
holder's update is answered or after ``deadline_s`` without one.

Synchronous rounds are the special case ``max_staleness = 0`` with one plan per version: the same
:func:`screen` decides both from the (device, base version) pair alone, before anything is decoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import AbstractSet, Any

from .gate import STALENESS_RULES, Verdict, refuse

__all__ = ["AsyncSettings", "VersionWindow", "screen"]


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


def screen(client: str, base: int, current: int | None, done: int, offered: Mapping[int, AbstractSet[str]],
           folded: Mapping[int, AbstractSet[str]], max_staleness: int = 0) -> Verdict | None:
    """A verdict from the (client, base version) pair alone, or None when the blob must be decoded.

    ``current``: the version taking updates (synchronous: the open round; None between rounds);
    ``done``: the last closed round; ``offered``: who was offered each version (the plans' selections);
    ``folded``: whose update trained from each version was already folded."""
    if client in folded.get(base, ()):
        return refuse("duplicate", "duplicate", f"the update of {client} for round {base} was already folded")
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
    (a slot while it was current), and whose update from each was folded."""

    max_staleness: int
    current: int = 0
    digests: dict[int, str] = field(default_factory=dict)
    offered: dict[int, set[str]] = field(default_factory=dict)
    folded: dict[int, set[str]] = field(default_factory=dict)

    def publish(self, version: int, digest: str) -> None:
        """Version ``version`` (model ``digest``) is now current; versions too old to be taken are forgotten
        (who was folded is kept a while longer, so a re-sent update is told ``duplicate``, not ``stale``)."""
        self.current = version
        self.digests[version] = digest
        keep, keep_folded = version - self.max_staleness, version - 2 * self.max_staleness - 2
        self.digests = {v: d for v, d in self.digests.items() if v >= keep}
        self.offered = {v: s for v, s in self.offered.items() if v >= keep}
        self.folded = {v: s for v, s in self.folded.items() if v >= keep_folded}

    def offer(self, clients: AbstractSet[str] | list[str]) -> None:
        self.offered.setdefault(self.current, set()).update(clients)

    def staleness(self, base: int) -> int:
        return self.current - base

    def screen(self, client: str, base: int) -> Verdict | None:
        return screen(client, base, self.current, self.current - 1, self.offered, self.folded, self.max_staleness)

    def fold(self, client: str, base: int) -> None:
        self.folded.setdefault(base, set()).add(client)

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
