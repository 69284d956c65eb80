"""Round policy, as pure functions of the clock: who is selected, and when a round closes.

Selection is the engine's (:func:`flayer.engine.select_devices`, over-selection among the devices
online, seeded from (run seed, round): the same draw on a restarted coordinator).

Closing (:class:`RoundTimer`, first rule that holds):

1. every selected device was accepted -> close now;
2. the quorum (capped at the number selected) was reached ``grace_s`` ago -> close;
3. the deadline passed with at least ``min_updates`` accepted -> close;
4. the deadline passed with fewer, and the round was not extended yet, and ``extend_s > 0`` ->
   extend the deadline once by ``extend_s`` (the plan is re-published with the new deadline);
5. the deadline passed otherwise -> close with what arrived (possibly nothing: the global model
   then stays as it was, rule ``carry``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flayer.engine import select_devices

__all__ = ["Decision", "RoundTimer", "select_devices"]


@dataclass(frozen=True)
class Decision:
    action: str  # wait | close | extend
    reason: str = ""


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

    @property
    def effective_quorum(self) -> int:
        return max(1, min(self.quorum, self.selected))

    def accepted(self, count: int, now: float) -> None:
        """Call after each accepted update (``count`` = accepted so far)."""
        if self.quorum_at is None and count >= self.effective_quorum:
            self.quorum_at = now

    def decide(self, count: int, now: float) -> Decision:
        if self.selected and count >= self.selected:
            return Decision("close", "every selected device reported")
        if self.quorum_at is not None and now >= self.quorum_at + self.grace_s:
            return Decision("close", f"quorum {self.effective_quorum} + grace {self.grace_s:g}s")
        if now < self.deadline:
            return Decision("wait")
        if count >= self.min_updates:
            return Decision("close", f"deadline with {count} update(s)")
        if not self.extended and self.extend_s > 0:
            return Decision("extend", f"deadline with {count} < {self.min_updates} update(s): extended once by "
                                      f"{self.extend_s:g}s")
        return Decision("close", f"deadline with only {count} update(s)")

    def extend(self) -> None:
        self.deadline += self.extend_s
        self.extended = True

    def next_wakeup(self) -> float:
        """When :meth:`decide` may change without a new update."""
        t = self.deadline
        if self.quorum_at is not None:
            t = min(t, self.quorum_at + self.grace_s)
        return t
