"""The one validity gate every update passes, and the admission policy the aggregation applies.

Validity (:func:`check`) is :func:`flayer.aggregate.check_update`: tensors of the global model, their
shapes, strictly increasing positions inside the tensor, finite values, a positive sample count;
it returns the L2 norm. Over MQTT the decoder runs it (``protocol.decode_update`` with the model's
shapes), in process the simulator does; nothing checks an update a second time.

Admission (:func:`admit`), given the checked norm, applies the round's policy:

- the norm bound: over it, ``reject`` (counter ``norm``) or ``clip`` (scaled down to it, counter
  ``clipped``);
- the weight cap: the aggregation weight is ``min(num_samples, max_samples)``;
- staleness (asynchronous rounds): an update trained from model version ``u`` and folded into the
  buffer of version ``v`` has staleness ``s = v - u``; beyond ``max_staleness`` it is refused
  (counter ``stale``), otherwise its deltas are scaled by the staleness weight (``sqrt``:
  ``1/sqrt(1+s)``, FedBuff's; ``inverse``: ``1/(1+s)``; ``constant``: 1) while its weight in the
  average stays ``n`` -- a stale update moves the model less, it does not shift the others' share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flayer.aggregate import check_update as check
from flayer.engine.privacy import upload_norm
from flayer.update import Update

__all__ = ["STALENESS_RULES", "Bounds", "Verdict", "admit", "check", "refuse", "scale_update", "staleness_weight"]

STALENESS_RULES = ("sqrt", "inverse", "constant")


@dataclass(frozen=True)
class Verdict:
    status: str  # accepted | duplicate | rejected | late | not_selected
    reason: str = ""
    counter: str | None = None
    update: Update | None = None  # as folded (clipped and staleness-scaled)
    norm: float = 0.0
    clipped: bool = False
    weight: float = 0.0  # the aggregation weight (num_samples, capped at max_samples)
    staleness: int = 0

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


def refuse(status: str, counter: str, reason: str) -> Verdict:
    return Verdict(status, reason[:500], counter)


@dataclass(frozen=True)
class Bounds:
    """What an open round admits (module docstring)."""

    norm_bound: float | None = None
    norm_policy: str = "reject"
    max_samples: int = 2**32
    max_staleness: int = 0
    staleness_rule: str = "sqrt"


def staleness_weight(staleness: int, rule: str = "sqrt") -> float:
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if rule == "sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if rule == "inverse":
        return 1.0 / (1.0 + staleness)
    if rule == "constant":
        return 1.0
    raise ValueError(f"staleness rule must be one of {STALENESS_RULES}, got {rule!r}")


def scale_update(update: Update, factor: float) -> Update:
    """``update`` with every delta multiplied by ``factor`` (clipping to a norm bound, staleness), in float64 and
    rounded to float32 after (:meth:`flayer.update.TensorDelta.scaled`)."""
    return Update({k: d.scaled(factor) for k, d in update.deltas.items()}, update.num_samples, update.info)


def _clip_to(update: Update, norm: float, bound: float) -> Update:
    """``update`` (of L2 norm ``norm`` > ``bound``) scaled to a norm of at most ``bound``, checked on the float32
    values it comes out as: each rounding may add half an ulp, and values that land among float32's subnormals
    keep few bits; where the result is still over ``bound`` it is scaled once more, and where even that is over,
    it comes out as zeros."""
    clipped = scale_update(update, bound / norm * (1 - 1e-6))
    after = upload_norm(clipped)
    if after > bound:
        clipped = scale_update(clipped, bound / after * (1 - 1e-6))
        if upload_norm(clipped) > bound:
            clipped = scale_update(update, 0.0)
    return clipped


def admit(update: Update, norm: float, bounds: Bounds, staleness: int = 0) -> Verdict:
    """The verdict on a checked update (``norm`` from :func:`check`)."""
    if staleness > bounds.max_staleness:
        return refuse("late", "stale", f"trained {staleness} model versions ago; at most {bounds.max_staleness} "
                                       f"are taken (max_staleness)")
    weight = float(min(update.num_samples, bounds.max_samples))
    factor, reason, clipped = 1.0, "", False
    if bounds.norm_bound is not None and norm > bounds.norm_bound:
        if bounds.norm_policy != "clip":
            return refuse("rejected", "norm", f"update norm {norm:.4g} exceeds the bound {bounds.norm_bound:.4g}")
        update = _clip_to(update, norm, bounds.norm_bound)
        reason, clipped = f"clipped from norm {norm:.4g} to {bounds.norm_bound:.4g}", True
    if staleness:
        factor = staleness_weight(staleness, bounds.staleness_rule)
    folded = update if factor == 1.0 else scale_update(update, factor)
    return Verdict("accepted", reason, None, folded, norm, clipped, weight, staleness)
