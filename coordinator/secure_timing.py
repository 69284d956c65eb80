"""How long each stage of a secure round waits, from the fleet's measured timing (docs/explanation/secure-aggregation.md,
"Stage deadlines").

Each stage's latency is the time from the stage's opening to a device's message of that stage (key advert, share
batch, consent, survivor signature, unmask answer), late ones included (a message that missed its stage still says how long
the fleet takes). A stage then waits ``FACTOR`` times the ``QUANTILE`` of the latencies measured over the last
``WINDOW`` rounds, at least ``FLOOR_S`` (never above the configured ``secure_stage_s``) and at most the ceiling the
coordinator gives (a third of the round's deadline): ``clamp(2 x p95, min(2 s, secure_stage_s), deadline / 3)``.
A device still online that had not answered when its stage closed counts at the stage's limit (a censored latency:
it took at least that long), so a stage that cut off live devices waits twice as long the next round, up to the
ceiling; a device gone offline counts nothing. Before any measurement a stage waits the ceiling (and, like every
stage, ends as soon as every device it waits for has answered or none that has not can still come:
:class:`coordinator.secure_round.SecureRound`).
"""

from __future__ import annotations

from collections import deque

__all__ = ["FACTOR", "FLOOR_S", "QUANTILE", "WINDOW", "StageTiming"]

FACTOR = 2.0
QUANTILE = 0.95
FLOOR_S = 2.0
WINDOW = 4  # rounds
STAGES = (1, 2, 4, 5, 6)  # keys, shares, consents, survivor signatures, unmask answers (stage 3, the masked inputs,
# is the round's timer)


class StageTiming:
    """The latencies of each stage over the last :data:`WINDOW` rounds and the limits they give (module docstring)."""

    def __init__(self, configured_s: float, ceiling_s: float) -> None:
        if not (configured_s > 0 and ceiling_s > 0):
            raise ValueError(f"stage limits must be positive, got {configured_s!r} and {ceiling_s!r}")
        self.configured_s = float(configured_s)
        self.ceiling_s = max(float(ceiling_s), min(FLOOR_S, self.configured_s))
        self._rounds: deque[dict[int, list[float]]] = deque(maxlen=WINDOW)

    def new_round(self) -> None:
        self._rounds.append({s: [] for s in STAGES})

    def observe(self, stage: int, latency_s: float) -> None:
        if stage in STAGES and latency_s >= 0 and self._rounds:
            self._rounds[-1][stage].append(float(latency_s))

    def censored(self, stage: int, limit_s: float, count: int) -> None:
        """``count`` devices, still online, had not answered when the stage closed after ``limit_s``."""
        for _ in range(max(0, count)):
            self.observe(stage, limit_s)

    def quantile(self, stage: int) -> float | None:
        """The :data:`QUANTILE` of the stage's measured latencies (None: none measured yet)."""
        xs = sorted(x for r in self._rounds for x in r.get(stage, ()))
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(QUANTILE * len(xs)))]

    def limit(self, stage: int) -> float:
        """How long the stage waits this round (module docstring)."""
        q = self.quantile(stage)
        if q is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(min(FLOOR_S, self.configured_s), FACTOR * q))

    def limits(self) -> dict[int, float]:
        return {s: round(self.limit(s), 3) for s in STAGES}
