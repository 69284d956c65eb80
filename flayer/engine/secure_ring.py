"""The ring of a secure round: as wide as the round's bounded, quantised sum needs, computed alike everywhere.

The coordinator and every device compute it from the plan's public fields (the per-coordinate range, the
resolution ``value_bits``, the noise shares' std and the cohort), so a plan stating another ring is refused
(:func:`flayer.engine.secure.secure_from_plan`); docs/explanation/secure-aggregation.md, "The ring".
"""

from __future__ import annotations

import math

from flayer.secagg import RingSpec
from flayer.secagg.ring import MAX_BITS, MAX_VALUE_BITS

from .privacy import RoundPrivacy

__all__ = ["NOISE_HEADROOM", "ROUNDING_SHARE", "ring_noise", "ring_range", "round_ring"]

NOISE_HEADROOM = 9.0  # standard deviations of a noise share's room in the ring (the cohort's sum cannot wrap)
ROUNDING_SHARE = 0.01  # distributed DP: the most the ring's rounding may widen the noise shares (1%)


def round_ring(value_range: float, cohort: int, value_bits: int, noise_std: float = 0.0) -> RingSpec:
    """The round's ring, computed alike by the coordinator and every device from the plan's public fields: values
    in ``[-value_range, value_range]`` resolved to ``value_bits`` bits, ``cohort`` summands, and room for noise
    shares of std ``noise_std`` (:data:`NOISE_HEADROOM` of them): only as wide as the bounded, quantised sum needs
    (:meth:`flayer.secagg.RingSpec.for_bound`)."""
    return RingSpec.for_bound(value_range, cohort, value_bits, NOISE_HEADROOM * noise_std)


def ring_noise(rp: RoundPrivacy | None, threshold: int, n: int, clip_range: float, cohort: int,
               value_bits: int = 16) -> tuple[float, RingSpec, int]:
    """(each device's discrete Gaussian share in the ring, its std in value units, or 0 without distributed DP;
    the round's ring, :func:`round_ring`; the resolution it uses, ``value_bits`` or more).

    Distributed DP (local-mode noise in a secure round, :mod:`flayer.secagg.noise`): the round is unmasked only
    with >= t survivors, so shares of variance ``(z_Delta C)^2 / t`` give the sum at least the noise
    ``(z_Delta C)^2`` the accountant composes, whoever drops out. In the ring a clipped upload's sensitivity grows
    by the stochastic rounding, at most ``sqrt(n)`` ring units over C s, so the share is widened by
    ``1 + sqrt(n) / (C s)``: the noise-to-sensitivity ratio stays z. The resolution is raised until that widening
    is at most :data:`ROUNDING_SHARE`, and each value's range gets :data:`NOISE_HEADROOM` standard deviations of
    room for the share, so the cohort's sum cannot wrap."""
    if rp is None or rp.mode != "local":
        return 0.0, round_ring(clip_range, cohort, value_bits), value_bits
    sigma = rp.sum_std / math.sqrt(threshold)
    floor = math.sqrt(n) / (rp.clip * ROUNDING_SHARE)  # the scale at which the widening is ROUNDING_SHARE
    while value_bits < MAX_VALUE_BITS:
        ring = round_ring(clip_range, cohort, value_bits)
        if ring.bits >= MAX_BITS or float(ring.scale or 0.0) >= floor:
            break
        value_bits += 1
    scale = round_ring(clip_range, cohort, value_bits).scale
    for _ in range(16):  # the share's room narrows a 32-bit ring's scale, which widens the share: a fixed point
        assert scale is not None
        widen = 1.0 + math.sqrt(n) / (rp.clip * scale)
        if widen > 1.1:
            raise ValueError(f"the ring is too coarse for distributed noise: rounding adds {widen - 1:.0%} to the "
                             f"sensitivity; lower secure_clip_range or the cohort")
        ring = round_ring(clip_range, cohort, value_bits, sigma * widen)
        if ring.scale == scale:
            return sigma * widen, ring, value_bits
        scale = ring.scale
    raise ValueError("no ring found for the distributed noise (the scale did not settle)")


def ring_range(value_range: float, adaptive: bool) -> float:
    """The range the ring holds: the values' own, or at least 1 with adaptive clipping (the clip bit rides along)."""
    return max(value_range, 1.0) if adaptive else value_range
