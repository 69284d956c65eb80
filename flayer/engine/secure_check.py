"""The checks of a secure round's unmasked sum (docs/explanation/secure-aggregation.md, "A hostile device inside a
secure round"): how far an honest sum may stray past its bounds, and the central noise a central-DP round adds
before it is checked (:func:`flayer.engine.secure.sum_update`)."""

from __future__ import annotations

import math

import numpy as np

from .privacy import RoundPrivacy

__all__ = ["allowances", "central_noise", "check_sum"]


def allowances(count: int, n: int, scale: float, noise_std: float) -> tuple[float, float]:
    """(per coordinate, L2): how far an honest sum of ``count`` inputs of ``n`` coordinates may stray past
    ``count`` x its bounds -- stochastic rounding (below 1/s a coordinate and input) and, with distributed DP,
    the noise shares' sum (std ``noise_std sqrt(count)`` a coordinate: 9 std per coordinate, its L2 norm
    below ``sqrt(n) + 6`` std; each exceeded with probability below 1e-8)."""
    sd = noise_std * math.sqrt(count)
    return count / scale + 9.0 * sd, count * math.sqrt(n) / scale + sd * (math.sqrt(n) + 6.0)


def check_sum(total: np.ndarray, count: int, bound: float | None, value_range: float | None = None,
              slack: tuple[float, float] = (0.0, 0.0), bits: float | None = None) -> str | None:
    """Why an unmasked sum cannot be ``count`` bounded uploads (None: it can). Each honest upload has L2 norm
    at most ``bound`` and coordinates in ``[-value_range, value_range]``, so their sum has norm at most
    ``count * bound`` and coordinates at most ``count * value_range``, plus ``slack`` (per coordinate, L2:
    :func:`allowances`); the clip-bit sum ``bits`` (adaptive clipping) lies in ``[0, count]`` plus the
    per-coordinate slack. A device that masked values outside its bounds shows here once it pushes the sum
    past them: what it can still do inside them is the residual docs/explanation/secure-aggregation.md states.
    The reason quotes no figure of the sum (it reaches the round record; the sum is un-noised in central mode)."""
    if count == 0:
        return None
    per, l2 = slack
    if bits is not None and not -per - 1e-9 <= bits <= count + per + 1e-9:
        return (f"the clip-bit sum is outside [0, {count}] (+ {per:.3g} for rounding and noise): a device "
                f"masked a clip bit other than 0 or 1")
    if value_range is not None and total.size and float(np.abs(total).max()) > count * value_range + per + 1e-9:
        return (f"a coordinate of the unmasked sum is beyond {count} x the range {value_range:g} (+ {per:.3g}): "
                f"a device masked values outside its range")
    if bound is None:
        return None
    norm = float(np.linalg.norm(total))
    if norm > count * bound + l2 + 1e-9:
        return (f"the unmasked sum's norm exceeds {count} x the bound {bound:g} (+ {l2:.3g}): a device "
                f"masked values outside its bound")
    return None


def central_noise(rp: RoundPrivacy | None) -> tuple[float, float] | None:
    """(the noise std on each coordinate of the sum, on the clip-bit count) a central-DP round adds, or None."""
    if rp is None or rp.mode != "central":
        return None
    return rp.sum_std, rp.bit_std
