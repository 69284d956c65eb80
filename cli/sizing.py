"""How many bytes an update takes on the wire, for the metrics of ``flayer simulate``/``flayer bench``."""

from __future__ import annotations

from typing import Callable

from flayer.update import Update

__all__ = ["update_sizer", "estimated_bytes"]


def update_sizer() -> Callable[[Update], int] | None:
    """The wire codec's encoded size of an update, when the ``protocol`` package provides the sparse
    update codec; None when it does not, and the metrics then carry coordinate and index counts only
    (see :func:`estimated_bytes`)."""
    return None


def estimated_bytes(values: int, indices: int) -> int:
    """Size estimate without the codec: fp32 values (4 bytes each) plus 4 bytes per explicit index."""
    return 4 * int(values) + 4 * int(indices)
