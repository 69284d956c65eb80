"""A device's own privacy ledger and budget (docs/explanation/privacy.md, "A device's own budget").

A device counts the private rounds it contributed to -- an upload (or a secure round's masked input) it
committed to disk before sending it, a neutral contribution included -- in its state file
(``extra["dp_ledger"]``, written atomically with the upload: it survives restarts and is never counted twice
for one round). It knows it took part, so no amplification by sampling applies: its epsilon composes each
contribution at q = 1 (:func:`flayer.engine.accountant.epsilon_for`: the exact composition, no library needed)
with the noise multiplier that protects its contribution from the parties that see it:

- ``central`` mode: z as the plan's named noises give it (the coordinator, which sees the clipped update, is
  trusted to add them; the readers of the published models see the noised sum);
- ``local`` mode with secure aggregation: z (the coordinator sees the noised sum only);
- ``local`` mode without: ``z_Delta / sqrt(m)``, the share of the noise its own update carries (the
  coordinator sees each update).

With a budget -- ``[privacy] device_budget`` in ``device.toml`` or the plan's ``device_budget``, the smaller of
the two -- the device refuses to train on a private round once that contribution would bring its epsilon past
the budget, whatever the coordinator asks: it logs why, and its status says ``budget spent`` (nothing more).
Epsilon is taken at the smaller of the plan's ``delta`` and the device's own ``[privacy] delta`` (``DEVICE_DELTA``,
1e-5, when device.toml names none): a coordinator cannot shrink the device's epsilon by raising the plan's delta.

The multiplier it books is the one the plan's *named* noises give (the update noise, and with adaptive clipping
the clip-bit noise at its sensitivity 1), never the plan's ``noise_multiplier`` label alone; in every mode it
refuses (status ``round skipped``) a private plan whose named noises are zero, or do not give its label
(:meth:`RoundPrivacy.noise_problem`). What it cannot check, it says once in its log: in central mode, that the
coordinator adds the noise its plan names (the device sees only the published model).

The participation schema (``[privacy] max_participations`` k, ``min_separation`` b): a plan carries the
schema its coordinator selects under (signed with the plan). The device refuses (status ``round skipped``) a
plan whose schema is looser than the one its own ``device.toml`` pins, or that names none when it pins one,
and a plan that would break the tighter of the two for itself by its own ledger: a (k+1)-th contribution, or
one fewer than b rounds after its last (:func:`schema_problem`). Its ledger does not move for a refused round.

The privacy floor (``[privacy] require``: ``"private"``, ``"local"``, ``"secure"``): the device refuses (status
``round skipped``) a training plan without the differential privacy, the local noise or the secure aggregation it
requires, and every calibration plan (:mod:`edge_client.privacy_floor`): a coordinator cannot downgrade it.

The coordinator writes the plans, and in local mode it is an adversary, so the device also refuses (status
``round skipped``) a private plan whose noise would be less than the multiplier it counts or that would send the
clip bit in the clear (:func:`plan_noise_problem`), and -- once it asks for privacy itself (its own budget or
delta) or has contributed to a private round -- a training round without privacy or a calibration round. In every
mode, whatever its budget or floor, it refuses a plan whose multiplier it would book (its own share's in local mode,
``z / sqrt(m)``) is below ``MIN_MULTIPLIER`` or gives an infinite one-round epsilon, and one whose ``contributions``
m its round cannot have (:func:`contributions_problem`: above a synchronous plan's selection, not below
``1 / delta``): a huge m would make its local noise vanish under a label that says z.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flayer.engine.accountant import epsilon_for
from flayer.engine.privacy import MIN_MULTIPLIER, RoundPrivacy
from flayer.privacy_config import ParticipationSchema
from protocol.metrics_schema import epsilon_value

from .privacy_floor import floor_problem

__all__ = ["BUDGET_SPENT", "DEVICE_DELTA", "LEDGER_KEY", "DeviceBudgets", "DeviceLedger", "contribution_multiplier",
           "contributions_problem", "counted_delta", "plan_limits", "plan_noise_problem", "plan_problem", "schema_problem"]

log = logging.getLogger("edge_client.client")

LEDGER_KEY = "dp_ledger"
DEVICE_DELTA = 1e-5  # the delta a device counts at when its device.toml names none (a plan may only lower it)
BUDGET_SPENT = "budget spent"  # the status's skip reason: nothing about the data
ROUND_SKIPPED = "round skipped"  # a private round's other skips, as generic


def contribution_multiplier(rp: RoundPrivacy, secure: bool) -> float:
    """The noise multiplier of one contribution, against the parties that see it (module docstring): from the
    noises the plan names (:attr:`RoundPrivacy.named_multiplier`: the update noise, and with adaptive clipping the
    clip-bit noise at sensitivity 1), never more than its ``noise_multiplier`` label."""
    if rp.mode == "local" and not secure and not rp.ring:
        return rp.update_multiplier / math.sqrt(rp.contributions)
    return rp.counted_multiplier


def counted_delta(plan_delta: float | None, own_delta: float | None) -> float:
    """The delta this device counts its epsilon at: the smaller of the plan's and its own (``DEVICE_DELTA`` when
    device.toml names none); a plan's larger delta never shrinks the epsilon a device counts."""
    return min(d for d in (plan_delta, own_delta or DEVICE_DELTA) if d is not None)


def plan_noise_problem(rp: RoundPrivacy, secure: bool, delta: float = DEVICE_DELTA) -> str | None:
    """Why this device refuses a private round as the plan writes it (None: it may contribute): in local mode
    the coordinator is an adversary and writes the plan, so a plan that would have the device add no noise, or
    send its clip bit outside any sum, is refused; in every mode, a plan whose contribution this device would book
    (:func:`contribution_multiplier`, what its own noise share gives in local mode) at a multiplier below
    ``MIN_MULTIPLIER``, or at an infinite one-round epsilon at ``delta``. ``secure``: the plan names a secure round
    (whose noise share :func:`flayer.engine.secure.secure_from_plan` checks against the plan's privacy)."""
    label = rp.noise_problem()  # every mode: a noise that is zero, or a label its named noises do not give
    if label is not None:
        return label
    booked = contribution_multiplier(rp, secure)  # not the label z: a huge m makes the local share z / sqrt(m)
    if not booked >= MIN_MULTIPLIER:
        return (f"this device would book its contribution at a noise multiplier of {booked:.3g} (z {rp.update_multiplier:g}"
                f"{f' / sqrt(m = {rp.contributions})' if booked != rp.counted_multiplier else ''}), below "
                f"{MIN_MULTIPLIER:g}: no noise a device can count")
    one = epsilon_for([(booked, 1.0, 1)], delta)
    if not math.isfinite(one):
        return (f"one round of it (noise multiplier {booked:.4g}) would cost this device epsilon {one:g} at delta "
                f"{delta:.3g}: no noise a device can count")
    if rp.mode != "local":
        return None  # central mode: the coordinator adds the noise, and is trusted with the clipped update
    if rp.adaptive:
        return "adaptive clipping in local mode would send the clip bit to the coordinator in the clear"
    if rp.ring and not secure:
        return "the plan draws the noise shares in a secure sum, and names no secure round: no noise would be added"
    return None


def contributions_problem(rp: RoundPrivacy, plan_mode: str, selected: int, plan_delta: float | None) -> str | None:
    """Why a plan's ``contributions`` m is not one its round can have, from public facts of the signed plan (None:
    it can): a synchronous round sums at most one contribution per selected device, so m above ``selected`` would
    only shrink each device's local share ``z C / sqrt(m)``; an asynchronous version sums ``buffer`` updates of
    devices drawn over time (m may exceed the current holders), and m counts devices of a population N the
    coordinator checked ``delta < 1/N`` against, so m must stay below ``1 / delta``."""
    m = rp.contributions
    if plan_mode != "async" and m > selected:
        return (f"its contributions m = {m} exceeds the {selected} device(s) it selects: a synchronous round sums at "
                f"most one contribution per selected device, and each device's noise share is z C / sqrt(m)")
    if plan_delta is not None and m * plan_delta >= 1:
        return (f"its contributions m = {m} is not below 1 / delta = {1 / plan_delta:.4g}: m counts devices of the "
                f"population N, and a plan's delta is below 1/N")
    return None


def plan_problem(plan: Any, rp: RoundPrivacy, own_delta: float | None = None) -> str | None:
    """Why this device refuses the private plan ``plan`` (its privacy ``rp``), or None: a malformed delta or budget
    (:func:`plan_limits`), contributions its round cannot have (:func:`contributions_problem`), noise it cannot
    count (:func:`plan_noise_problem`, at the delta :func:`counted_delta` gives with ``own_delta``)."""
    try:
        plan_delta, _ = plan_limits(plan.privacy)
    except ValueError as exc:
        return str(exc)
    return contributions_problem(rp, str(plan.mode), len(set(plan.selected)), plan_delta) \
        or plan_noise_problem(rp, bool(plan.secure), counted_delta(plan_delta, own_delta))


def _positive(raw: Any, name: str) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (math.isfinite(raw) and raw > 0):
        raise ValueError(f"plan: privacy {name} must be a finite number > 0, got {raw!r}")
    return float(raw)


def plan_limits(raw: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(delta, device_budget) a private plan names (None: not named); ValueError when malformed."""
    delta = _positive(raw.get("delta"), "delta")
    if delta is not None and delta >= 1:
        raise ValueError(f"plan: privacy delta must be < 1, got {delta}")
    return delta, _positive(raw.get("device_budget"), "device_budget")


def schema_problem(raw: Mapping[str, Any], pinned: ParticipationSchema, count: int, last: int,
                   round_: int) -> str | None:
    """Why a device that contributed ``count`` private rounds, the last ``last`` (0: none), refuses ``round_``
    under a plan's privacy mapping ``raw`` and the schema it pins (module docstring), or None."""
    planned = ParticipationSchema.from_plan(raw)  # ValueError: malformed
    looser = planned.looser_than(pinned) if pinned.active else None
    if looser is not None:
        return f"participation schema: {looser}"
    if count > 0 and round_ <= last:  # a re-sent upload never comes here: only a round to train (again)
        return (f"round {round_} is not after round {last}, the last private round in this device's ledger: a round "
                f"is contributed to once (another upload of it would carry fresh noise the ledger does not count)")
    schema = planned.tightest(pinned)
    if not schema.active:
        return None
    why = schema.refuses_count(count, last if count > 0 else None, round_)
    return None if why is None else f"participation schema: {why}"


@dataclass
class DeviceLedger:
    """The contributions so far, as ``[z, rounds]`` runs, and the last round counted."""

    runs: list[tuple[float, int]] = field(default_factory=list)
    last_round: int = 0

    @property
    def rounds(self) -> int:
        return sum(n for _, n in self.runs)

    def epsilon(self, delta: float, extra: tuple[float, int] | None = None) -> float:
        return epsilon_for([(z, 1.0, n) for z, n in self.runs + ([extra] if extra else [])], delta)

    def record(self, z: float, round_: int) -> None:
        if round_ <= self.last_round:
            return  # this round is counted already (a re-sent upload)
        if self.runs and self.runs[-1][0] == z:
            self.runs[-1] = (z, self.runs[-1][1] + 1)
        else:
            self.runs.append((float(z), 1))
        self.last_round = round_

    def state(self) -> dict[str, Any]:
        return {"runs": [[z, n] for z, n in self.runs], "last_round": self.last_round}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> DeviceLedger:
        """The ledger in a state file's ``extra`` (empty when there is none); ValueError when malformed."""
        raw = extra.get(LEDGER_KEY)
        if raw is None:
            return cls()
        try:
            runs = [(float(z), int(n)) for z, n in raw["runs"]]
            last = int(raw["last_round"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the state file's privacy ledger is malformed ({exc})") from None
        if any(not (z >= 0 and math.isfinite(z)) or n < 1 for z, n in runs) or last < 0:
            raise ValueError(f"the state file's privacy ledger is out of range: {raw!r}")
        return cls(runs, last)


class DeviceBudgets:
    """The edge client's ledger and budget checks: a mixin of :class:`edge_client.client.EdgeClient`."""

    id: str
    settings: Any
    stored: Any
    skipped: dict[int, str]
    _heartbeat_at: float
    _budget_state: tuple[float | None, bool] = (None, False)  # (delta, at budget) of the last check, for the status
    _central_unchecked_said = False  # the log has said what a central-mode device cannot check

    def _ledger(self) -> DeviceLedger:
        return DeviceLedger.from_extra(self.stored.extra)

    def _own_privacy(self) -> bool:
        """This device asks for privacy itself -- its own ``[privacy] device_budget``, ``delta``, schema, or a
        ``require`` naming differential privacy -- or has contributed to a private round already: it then takes part
        in private training rounds only."""
        if self.settings.device_budget or self.settings.device_delta or self._pinned_schema().active \
                or {"private", "local"} & set(getattr(self.settings, "privacy_require", ())):
            return True
        try:
            return self._ledger().rounds > 0
        except ValueError:
            return True

    def _pinned_schema(self) -> ParticipationSchema:
        """The participation schema this device's own settings pin (edge_client.config)."""
        return ParticipationSchema(getattr(self.settings, "max_participations", 0) or None,
                                   getattr(self.settings, "min_separation", 0))

    def _schema_problem(self, plan: Any) -> str | None:
        """:func:`schema_problem` for a private plan against this device's ledger and pinned schema."""
        try:
            ledger = self._ledger()
            return schema_problem(plan.privacy, self._pinned_schema(), ledger.rounds, ledger.last_round, plan.round)
        except ValueError as exc:
            return str(exc)

    def _budget_refuses(self, plan: Any) -> bool:
        """True when this device must not contribute to ``plan``: a plan below the floor its ``[privacy] require``
        pins (:func:`edge_client.privacy_floor.floor_problem`); a private round whose next contribution would
        pass its budget (or the budget cannot be checked) or whose noise is less than the device would count
        (:func:`plan_noise_problem`); with :meth:`_own_privacy`, a training round without privacy or a
        calibration round (its report is the device's data, un-noised). Logs the refusal once per round."""
        if plan.phase not in ("train", "calibrate"):
            return False
        floor = floor_problem(getattr(self.settings, "privacy_require", ()), plan.phase, plan.privacy,
                              bool(plan.secure))  # [privacy] require: secure aggregation, local noise (privacy_floor)
        if floor is not None:
            problem: str | None = floor
            reason = ROUND_SKIPPED
        elif plan.phase == "calibrate" or not plan.privacy:
            if not self._own_privacy():
                return False
            why = (f"a {plan.phase} round without privacy: this device contributes to private training "
                   f"rounds only (its own [privacy] settings, or a private round already contributed)")
            reason = ROUND_SKIPPED
            problem = why
        else:
            problem, reason = self._noise_problem(plan) or self._schema_problem(plan), ROUND_SKIPPED
            if problem is None:  # "budget spent" only when the ledger is at its budget, not a plan too costly alone
                problem = self._budget_problem(plan)
                reason = BUDGET_SPENT if self._budget_state[1] else ROUND_SKIPPED
        if problem is None:
            return False
        if self.skipped.get(plan.round) != reason:
            self.skipped[plan.round] = reason
            log.warning("%s: refusing round %d: %s", self.id, plan.round, problem)
            self._heartbeat_at = 0.0  # the status saying so goes out now
        return True

    def _noise_problem(self, plan: Any) -> str | None:
        """:func:`plan_problem` for a private plan, or why its privacy mapping is malformed."""
        try:
            rp = RoundPrivacy.from_plan(plan.privacy)
        except ValueError as exc:
            return str(exc)  # a malformed private plan is refused whether or not this device has a budget
        if rp is None:
            return None
        problem = plan_problem(plan, rp, self.settings.device_delta or None)
        if problem is None and rp.mode == "central" and not getattr(self, "_central_unchecked_said", False):
            self._central_unchecked_said = True
            log.info("%s: central privacy: this device counts z %.4g from the noise round %d's plan names; it cannot "
                     "check that the coordinator adds that noise (it sees only the published model)", self.id,
                     contribution_multiplier(rp, bool(plan.secure)), plan.round)
        return problem

    def _budget_problem(self, plan: Any) -> str | None:
        own_budget, own_delta = self.settings.device_budget or None, self.settings.device_delta or None
        try:
            rp = RoundPrivacy.from_plan(plan.privacy)
            plan_delta, plan_budget = plan_limits(plan.privacy)
            ledger = self._ledger()
        except ValueError as exc:
            self._budget_state = (own_delta, own_budget is not None)
            return str(exc) if own_budget is not None else None
        assert rp is not None
        delta = counted_delta(plan_delta, own_delta)  # a plan's larger delta would shrink every epsilon counted
        budgets = [b for b in (plan_budget, own_budget) if b is not None]
        budget = min(budgets) if budgets else None
        if budget is None:
            self._budget_state = (delta, False)
            return None
        z = contribution_multiplier(rp, bool(plan.secure))
        spent, after, alone = ledger.epsilon(delta), ledger.epsilon(delta, (z, 1)), epsilon_for([(z, 1.0, 1)], delta)
        at_budget = after > budget and alone <= budget  # a plan too costly on its own leaves the budget unspent
        self._budget_state = (delta, at_budget)
        if alone > budget:
            return (f"one round of it alone (z {z:.4g}, q = 1) would cost epsilon {alone:.4g} at delta {delta:.3g}, "
                    f"past the budget {budget:g}; {ledger.rounds} private rounds contributed, epsilon {spent:.4g}")
        if not at_budget:
            return None
        return (f"its privacy budget is spent: {ledger.rounds} private rounds contributed, epsilon {spent:.4g} at "
                f"delta {delta:.3g}; one more (z {z:.4g}, q = 1) would make it {after:.4g}, past the budget "
                f"{budget:g}")

    def _record_contribution(self, privacy: Mapping[str, Any], secure: bool, round_: int) -> None:
        """Count a private round (its plan's ``privacy`` mapping, whether it is secure) in the ledger, before the
        state file that names its upload is written."""
        rp = RoundPrivacy.from_plan(privacy) if privacy else None
        if rp is None:
            return
        try:
            ledger = self._ledger()
        except ValueError as exc:  # with a budget the round was refused (_budget_problem); without, start afresh
            log.warning("%s: %s; starting a new one", self.id, exc)
            ledger = DeviceLedger()
        ledger.record(contribution_multiplier(rp, secure), round_)
        self.stored.extra[LEDGER_KEY] = ledger.state()

    def _privacy_status(self) -> dict[str, float | int | bool | str]:
        """What the status says of this device's ledger: rounds contributed, its epsilon (when a delta is
        known; ``"inf"`` when a booked round had no noise it can count, the wire's one word for an infinite epsilon)
        and whether it is at its budget -- functions of the rounds it took part in and the plans' parameters,
        nothing of its data."""
        try:
            ledger = self._ledger()
        except ValueError:
            return {}
        if ledger.rounds == 0 and not self._budget_state[1]:
            return {}
        delta, at_budget = self._budget_state
        out: dict[str, float | int | bool | str] = {"dp_rounds": ledger.rounds, "dp_at_budget": at_budget}
        eps = ledger.epsilon(delta) if delta is not None else None
        if eps is not None:
            out["dp_epsilon"] = epsilon_value(round(eps, 6))  # "inf" when infinite, as the round records write it
        return out
