"""What the coordinator's log says of a round as it closes, beside the numbers ``metrics.jsonl`` keeps:
whether a secure round unmasked its sum (of how many masked inputs) or was abandoned, and the epsilon
spent so far at the round's delta against each adversary it holds for (docs/explanation/privacy.md: the
accountant's figures, for zero-out neighbours: readers of the models and plans, and the coordinator)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flayer.engine.adversaries import ADVERSARIES
from flayer.privacy_config import ParticipationSchema

__all__ = ["closing_notes"]


def closing_notes(record: Mapping[str, Any]) -> str:
    """``"; secure: ...; epsilon ..."`` for a round record (empty for a plain round without privacy)."""
    notes = []
    if "secure_survivors" in record:
        survivors, dropped = record.get("secure_survivors") or [], record.get("secure_dropped") or []
        if record.get("secure_abandoned"):
            notes.append(f"secure round abandoned ({record['secure_abandoned']}), nothing unmasked")
        else:
            notes.append(f"secure round unmasked: the sum of {len(survivors)} masked inputs only"
                         f"{f', {len(dropped)} device(s) dropped out' if dropped else ''}")
    if record.get("epsilon") is not None:
        notes.append(f"epsilon {_eps(record['epsilon'])} spent so far at delta {float(record['delta']):.3g} against "
                     f"{ADVERSARIES['public']}, {_eps(record.get('epsilon_coordinator', 'inf'))} against the "
                     f"coordinator (zero-out neighbours), for {ParticipationSchema.of_record(record).describe()}")
    return "".join(f"; {n}" for n in notes)


def _eps(eps: Any) -> str:
    return eps if isinstance(eps, str) else f"{float(eps):.4g}"
