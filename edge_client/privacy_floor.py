"""The privacy floor a device pins in its own ``device.toml``: ``[privacy] require`` (docs/explanation/privacy.md,
"The privacy floor a device pins").

The coordinator writes the round plans, so whatever a federation promised when a device joined it -- secure
aggregation, noise added on the devices -- a later plan could drop. ``require`` names what every round this device
contributes to must run under, whatever the plan says; each condition is one the device reads off the signed plan:

- ``"private"``: differential privacy in any mode (the plan names its privacy: the update is clipped and noised;
  in central mode the coordinator, which adds the noise, sees the clipped update);
- ``"local"``: the noise is added on the device (the plan's privacy ``mode = "local"``); implies ``"private"``; the
  share the plan names is checked on every device whatever its floor (:func:`edge_client.budget.plan_problem`: a
  huge ``contributions`` m would shrink it to nothing under the label);
- ``"secure"``: secure aggregation (the plan names a secure round: the coordinator sees only the round's sum; the
  device masks its input or sends nothing, :mod:`edge_client.secure`).

``["secure", "local"]`` asks for both: the coordinator then sees only the noised sum (distributed noise). ``"none"``
(the default, or ``[]``) pins nothing. A plan that breaks the floor is refused for this device alone: it neither
trains nor uploads for that round, its ledger does not move, and it stays connected for the next plans
(:meth:`edge_client.budget.DeviceBudgets._budget_refuses` logs why once a round).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REQUIREMENTS", "floor_problem", "parse_require", "require_text"]

REQUIREMENTS = ("private", "local", "secure")  # what a device may require of every round it contributes to


def parse_require(value: Any) -> tuple[str, ...]:
    """``[privacy] require`` as a sorted tuple of :data:`REQUIREMENTS` (empty: no floor); ValueError naming what is
    wrong. A string names one requirement (or ``"none"``), a list several."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ValueError(f"require must be \"none\", one of {', '.join(map(repr, REQUIREMENTS))} or a list of "
                         f"them, got {value!r}")
    if list(items) == ["none"]:
        return ()
    bad = [v for v in items if v not in REQUIREMENTS]
    if bad:
        raise ValueError(f"require: {bad[0]!r} is not one of {', '.join(map(repr, REQUIREMENTS))} (or \"none\" "
                         f"alone), got {value!r}")
    return tuple(sorted(set(items)))


def require_text(require: tuple[str, ...]) -> str:
    """The floor as ``device.toml`` writes it, for log lines."""
    return f'require = "{require[0]}"' if len(require) == 1 else \
        "require = [" + ", ".join(f'"{r}"' for r in require) + "]"


def _asked(phase: str, privacy: Mapping[str, Any], secure: bool) -> str:
    """What a plan asks of the round, in the floor's words."""
    mode = privacy.get("mode") if privacy else None
    noise = f"{mode}-mode noise" if isinstance(mode, str) and mode in ("central", "local") else \
        ("malformed privacy" if privacy else "no privacy")
    return f"a {'training' if phase == 'train' else 'calibration'} round with {noise}, {'under' if secure else 'without'} secure aggregation"


def floor_problem(require: tuple[str, ...], phase: str, privacy: Mapping[str, Any], secure: bool) -> str | None:
    """Why a device pinning ``require`` refuses a plan of ``phase`` with the ``privacy`` mapping and (``secure``)
    naming a secure round, or None when the plan meets the floor."""
    if not require:
        return None
    train = phase == "train"  # a calibration report is the device's un-noised sensitivity curve, sent in the clear
    private, secure_round = bool(privacy) and train, secure and train
    mode = privacy.get("mode") if private else None
    met = {"private": private, "local": mode == "local", "secure": secure_round}
    if all(met[r] for r in require):
        return None
    return (f"this device's [privacy] {require_text(require)} (device.toml) is not met: the plan asks for "
            f"{_asked(phase, privacy, secure)}")
