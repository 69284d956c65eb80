"""The two ways a secure-aggregation round ends badly (docs of :mod:`flayer.secagg`).

:class:`SecAggError` is a refusal: a message that does not authenticate, does not parse, comes at
the wrong stage, or asks a device for something the protocol forbids (both shares of one neighbour).
It subclasses ``ValueError`` so a wire layer that treats every malformed input as ``ValueError``
catches it too. :class:`SecAggAbandoned` is the protocol's own abort: too few devices are left
(fewer than the threshold t) to finish the round; ``reason`` says which count fell short.
"""

from __future__ import annotations

__all__ = ["SecAggAbandoned", "SecAggError"]


class SecAggError(ValueError):
    """A message or request is refused (malformed, unauthenticated, out of order or forbidden)."""


class SecAggAbandoned(RuntimeError):
    """The round cannot finish: fewer than t devices or shares are left (Bonawitz et al. 2017, Fig. 4)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
