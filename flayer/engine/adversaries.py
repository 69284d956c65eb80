"""Epsilon against each adversary of a private federation (docs/explanation/privacy.md, "Who learns what").

Two views, one ledger each (:class:`flayer.engine.accountant.Ledger`, every round at ``q = 1``: the cohort
is public, so nobody is uncertain about who took part):

- ``public``: **readers of the published models, the devices and observers of the broker** (they also read
  the plans, which list ``selected`` and the round's C, z and m). What they see of a round is the next
  model: the clipped sum plus the noise that was actually in it, over m. Central mode: ``z``. Local mode:
  the shares that arrived, ``k`` of the ``m`` they were sized for, carry ``z sqrt(k / m)``; a round that
  closes short is composed with that smaller multiplier (never with the planned one). Secure rounds with
  local noise draw the shares in the ring sized for the protocol's threshold ``t`` (``k >= t`` survivors
  unmask), so the sum carries at least ``z``.
- ``coordinator``: **the coordinator** (and whoever holds its host). Central mode, with or without secure
  aggregation: it sees the un-noised clipped updates, or their un-noised sum: **no guarantee** (infinite).
  Local mode without secure aggregation: it sees each device's upload with that device's own share,
  ``N(0, (z C)^2 / m)``: a Gaussian mechanism of multiplier ``z / sqrt(m)`` per round. Local mode with
  secure aggregation (distributed DP): only the sum, so the ``public`` figure, plus every sum it unmasked and
  then refused (:meth:`Accounts.unmasked_unfolded`).

With a participation schema (``most`` = ``[privacy] max_participations``) both figures are a device's in at
most ``most`` rounds: the rounds with the least noise, ``most``-fold (:func:`flayer.engine.accountant.worst_rounds`).

Both assume the coordinator runs the mechanism as written (it clips, adds its noise, keeps the fixed
denominator); only the local-mode figure against the coordinator holds when it does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .accountant import Ledger, LedgerError
from .privacy import RoundPrivacy

__all__ = ["ADVERSARIES", "Accounts"]

# what each figure is against, as the round records, `flayer simulate` and `flayer privacy` name it
ADVERSARIES = {"public": "readers of the published models, devices and broker observers (plans list the cohort)",
               "coordinator": "the coordinator"}


@dataclass
class Accounts:
    """The federation's two ledgers (module docstring). ``coordinator`` None: no guarantee against it."""

    mode: str  # "central" or "local"
    secure: bool  # secure aggregation: the coordinator sees only sums
    public: Ledger = field(default_factory=Ledger)
    coordinator: Ledger | None = None
    most: int | None = None  # the participation schema's max_participations (None: a device in every round)

    def __post_init__(self) -> None:
        if self.mode == "local" and self.coordinator is None:
            self.coordinator = Ledger()

    def round_z(self, rp: RoundPrivacy, arrived: int) -> float:
        """The multiplier of the noise the round's sum actually carries, ``arrived`` uploads folded: the one its
        named noises give (:attr:`flayer.engine.privacy.RoundPrivacy.named_multiplier`, never more than its label),
        which with adaptive clipping counts the clip-bit count's noise at sensitivity 1."""
        if rp.mode == "central" or rp.ring:
            return rp.counted_multiplier
        return rp.update_multiplier * math.sqrt(arrived / rp.contributions)

    def worst_z(self, rp: RoundPrivacy, fewest: int) -> float:
        """The smallest multiplier a round may close with: ``fewest`` uploads (the round's minimum count)."""
        return self.round_z(rp, max(1, fewest))

    def compose(self, rp: RoundPrivacy, arrived: int) -> float:
        """Compose a closed round of which ``arrived`` uploads were folded (none: the models did not move, nothing
        is composed for their readers -- but in local mode without secure aggregation the coordinator may still
        have read uploads it did not fold, late or refused, so its ledger composes every round); the round's
        public multiplier."""
        z = self.round_z(rp, arrived)
        if arrived <= 0:
            if self.coordinator is not None and not self.secure:
                self.coordinator.compose(rp.update_multiplier / math.sqrt(rp.contributions), 1.0)
            return z
        self.public.compose(z, 1.0)
        if self.coordinator is not None:
            self.coordinator.compose(z if self.secure else rp.update_multiplier / math.sqrt(rp.contributions), 1.0)
        return z

    def unmasked_unfolded(self, rp: RoundPrivacy) -> None:
        """A secure round whose sum the coordinator unmasked, then refused (it broke the round's bounds). The
        models did not move, but whether they moved is published and was decided on the noised sum -- a hostile
        device masking a value at the edge of the bounds makes that decision a threshold on it -- so the round is
        composed for the models' readers too, and against the coordinator (and the broker operator, who can
        unmask what it relays), which saw the noised sum. Central mode: no figure against the coordinator."""
        z = self.round_z(rp, rp.contributions)
        self.public.compose(z, 1.0)
        if self.coordinator is not None and self.secure:
            self.coordinator.compose(z, 1.0)

    def public_epsilon(self, delta: float) -> float:
        """Against readers of the models, under the schema (``most``)."""
        return self.public.epsilon(delta, self.most)

    def public_after(self, z: float, delta: float) -> float:
        """:meth:`public_epsilon` were one more round at multiplier ``z`` composed."""
        return self.public.epsilon_after(z, 1.0, delta, 1, self.most)

    def epsilons(self, delta: float) -> dict[str, float]:
        """``{"public": eps, "coordinator": eps}`` at ``delta`` (inf: no guarantee), under the schema."""
        return {"public": self.public_epsilon(delta),
                "coordinator": math.inf if self.coordinator is None else self.coordinator.epsilon(delta, self.most)}

    def state(self) -> dict[str, Any]:
        return {"ledger": self.public.state(),
                "coordinator_ledger": None if self.coordinator is None else self.coordinator.state()}

    @classmethod
    def restore(cls, mode: str, secure: bool, raw: Mapping[str, Any]) -> tuple[Accounts, bool]:
        """From a checkpoint's privacy state: (the accounts, whether runs composed with sampling by an
        earlier release were recomposed at q = 1). LedgerError when malformed."""
        saved = Ledger.from_state(raw.get("ledger", []))
        sampled = any(q < 1 for _, q, _ in saved.history)
        out = cls(mode, secure)
        for z, _, n in saved.history:  # an earlier release composed sampled rounds: recomposed at q = 1
            out.public.compose(z, 1.0, n)
        coord = raw.get("coordinator_ledger")
        if out.coordinator is not None:  # local mode; a checkpoint without that ledger: no figure against it
            out.coordinator = Ledger.from_state(coord) if coord is not None else \
                Ledger() if not out.public.rounds else None
        if out.coordinator is not None and out.coordinator.rounds < out.public.rounds:
            # every round composed for the models' readers was seen by the coordinator first
            raise LedgerError(f"privacy ledger: the coordinator's composes {out.coordinator.rounds} rounds, fewer "
                              f"than the {out.public.rounds} composed for the models' readers")
        return out, sampled
