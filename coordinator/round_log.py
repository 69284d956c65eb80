"""What the coordinator's log says of a round as it closes, beside the numbers ``metrics.jsonl`` keeps:
whether a secure round unmasked its sum (of how many masked inputs) or was abandoned, and the epsilon
spent so far at the round's delta (docs/explanation/privacy.md: the accountant's figure, under its stated
assumptions about sampling and the adversary who sees every released model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
        eps = record["epsilon"]
        notes.append(f"epsilon {eps if isinstance(eps, str) else f'{eps:.4g}'} spent so far at delta "
                     f"{float(record['delta']):.3g}")
    return "".join(f"; {n}" for n in notes)
