"""Plain-text and markdown tables for command summaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if markdown:
        lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
                 "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    else:
        lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
