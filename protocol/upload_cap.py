"""What a round plan lets devices choose for their uploads (its ``upload_fit`` field).

A device with ``[edge] upload = "fit"`` picks, per round, the value codec and the share of its
masked coordinates that let its upload arrive before the deadline (:mod:`edge_client.linkfit`).
The coordinator bounds that choice (``[federation] fit_lowest_codec``, ``fit_min_keep``): codecs
from the plan's ``value_codec`` down the ladder fp32 -> fp16 -> int8, never below ``lowest``, and
at least ``min_keep`` of the coordinates the strategy's masks select. An empty field lets devices
choose nothing: they upload with the plan's codec, as a fixed choice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import WireError

__all__ = ["CODEC_LADDER", "UploadCap", "codec_ladder", "upload_cap"]

CODEC_LADDER = ("fp32", "fp16", "int8")  # bf16 has no place: fp16 is as small and more precise here


@dataclass(frozen=True)
class UploadCap:
    lowest: str = "int8"
    min_keep: float = 0.1

    def problems(self) -> str | None:
        if self.lowest not in CODEC_LADDER:
            return f"lowest must be one of {', '.join(CODEC_LADDER)}, got {self.lowest!r}"
        if type(self.min_keep) not in (int, float) or not (math.isfinite(self.min_keep) and 0 < self.min_keep <= 1):
            return f"min_keep must be in (0, 1], got {self.min_keep!r}"
        return None

    def as_plan(self) -> dict[str, str | float]:
        return {"lowest": self.lowest, "min_keep": float(self.min_keep)}


def upload_cap(field: Mapping[str, Any]) -> UploadCap | None:
    """The plan's ``upload_fit`` field (None when empty); WireError when malformed."""
    if not field:
        return None
    if set(field) != {"lowest", "min_keep"}:
        raise WireError(f"plan upload_fit: fields must be exactly lowest and min_keep, got {sorted(field)}")
    cap = UploadCap(field["lowest"], field["min_keep"])
    problem = cap.problems()
    if problem:
        raise WireError(f"plan upload_fit: {problem}")
    return cap


def codec_ladder(start: str, lowest: str) -> list[str]:
    """The codecs a device may try, best first: from ``start`` (bf16 counts as fp16) down to ``lowest``."""
    first = CODEC_LADDER.index("fp16" if start == "bf16" else start)
    last = max(first, CODEC_LADDER.index(lowest))
    return list(CODEC_LADDER[first:last + 1])
