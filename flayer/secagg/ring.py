"""Fixed-point quantisation of float updates into the ring Z_{2^bits} that secure aggregation sums in.

Masks cancel only in modular arithmetic, so each device maps its clipped floats to integers before
masking (Bonawitz et al., CCS 2017, Sec. 3; Bell et al., CCS 2020, Sec. 5 quantise the same way):

1. clip every coordinate to ``[-clip_range, clip_range]`` (C below);
2. multiply by ``scale`` (s) and round to an integer q with ``|q| <= q_max = ceil(C * s)``;
3. store q mod 2^bits in a ``uint32`` (two's complement for negatives).

Rounding is **stochastic** when a ``numpy.random.Generator`` is passed (q = floor(a) + [u < frac(a)],
u uniform in [0, 1)): unbiased, E[q] = a, so the error of an average over many devices shrinks
instead of accumulating a bias, and every error is still below 1/s. With ``rng=None`` it rounds to
nearest (error <= 1/(2s), deterministic). Either way, per coordinate and per summand,
``|q / s - clip(x)| < 1 / s`` always, so a decoded sum of ``count`` summands is within ``count / s``
of the sum of the clipped values.

**No wrap-around**: the sum of ``m <= max_summands`` quantised values satisfies
``|sum| <= m * q_max <= max_summands * ceil(C * s) <= 2^(bits-1) - 1``, which :class:`RingSpec`
checks on construction (a ring too narrow for its cohort and range is refused), so the signed reading
of the ring sum is the integer sum itself. :meth:`RingSpec.for_summands` picks the largest
power-of-two ``s`` that meets the bound in a ring of given width (a power of two makes ``q / s`` exact
in float64).

**Width from the bound** (:meth:`RingSpec.for_bound`): a ring only as wide as the bounded, quantised sum
needs. ``s`` gives one device's value ``value_bits`` bits of resolution over its range R (the largest
power of two with ``R s <= 2^(value_bits - 1)``); the sum of ``m`` values, each within
``ceil((R + headroom) s)`` (headroom: room for noise added in the ring), needs
``bits = bit_length(m * ceil((R + headroom) s)) + 1`` (the sign) ``+ margin_bits``. The margin makes the
honest range at most half the ring, so a sum that wrapped (a device's values outside its range, a wrong
count) reads outside the honest range -- where :func:`decode_sum` refuses it -- for at least half of all
possible sums; honest sums cannot wrap at all. A cohort too large for 32 bits at that resolution gets
the 32-bit ring of :meth:`RingSpec.for_summands` (a coarser ``s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .prg import KeystreamRandom

__all__ = ["MARGIN_BITS", "MAX_BITS", "MAX_VALUE_BITS", "MIN_VALUE_BITS", "RingSpec", "decode_sum", "encode"]

MAX_BITS = 32  # the masks are uint32; a narrower ring is their low bits
MIN_VALUE_BITS, MAX_VALUE_BITS = 8, 30  # resolution of one device's value over its range (RingSpec.for_bound)
MARGIN_BITS = 1  # above what the honest sum needs: a wrapped sum reads out of range at least half the time


@dataclass(frozen=True)
class RingSpec:
    """Clip range C, ring width ``bits``, fixed-point ``scale`` s, and the most summands the sum may have.

    ``scale=None`` picks the largest power of two with ``max_summands * ceil(C * s) < 2^(bits-1)``.
    An explicit ``scale`` must meet the same bound (ValueError otherwise).
    """

    clip_range: float
    bits: int = 32
    scale: float | None = None
    max_summands: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.clip_range, (int, float)) and math.isfinite(self.clip_range)
                and self.clip_range > 0):
            raise ValueError(f"clip_range must be a finite number > 0, got {self.clip_range!r}")
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 2 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be an integer in [2, {MAX_BITS}], got {self.bits!r}")
        if (not isinstance(self.max_summands, int) or isinstance(self.max_summands, bool)
                or self.max_summands < 1):
            raise ValueError(f"max_summands must be an integer >= 1, got {self.max_summands!r}")
        limit = self.sum_limit
        if self.max_summands > limit:
            raise ValueError(f"max_summands {self.max_summands} cannot fit in {self.bits} bits "
                             f"(at most {limit} summands of one unit each)")
        if self.scale is None:
            object.__setattr__(self, "scale", _largest_scale(float(self.clip_range), self.max_summands, limit))
        scale = self.scale
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        object.__setattr__(self, "scale", float(scale))
        if self.max_summands * self.q_max > limit:
            raise ValueError(f"scale {scale} overflows: max_summands * ceil(clip_range * scale) = "
                             f"{self.max_summands * self.q_max} > 2^(bits-1) - 1 = {limit}")

    @classmethod
    def for_summands(cls, clip_range: float, max_summands: int, bits: int = 32) -> RingSpec:
        """The spec whose sums of up to ``max_summands`` values in ``[-clip_range, clip_range]`` never wrap."""
        return cls(clip_range=clip_range, bits=bits, scale=None, max_summands=max_summands)

    @classmethod
    def for_bound(cls, value_range: float, max_summands: int, value_bits: int, headroom: float = 0.0,
                  margin_bits: int = MARGIN_BITS) -> RingSpec:
        """The narrowest ring in which ``max_summands`` values in ``[-value_range - headroom, value_range +
        headroom]``, each resolved to ``value_bits`` bits over ``value_range``, sum without wrapping, plus
        ``margin_bits`` (module docstring); the 32-bit ring of :meth:`for_summands` when that is too narrow.
        ValueError for a range, cohort, resolution or headroom out of bounds."""
        if not (isinstance(value_range, (int, float)) and math.isfinite(value_range) and value_range > 0):
            raise ValueError(f"value_range must be a finite number > 0, got {value_range!r}")
        if (not isinstance(value_bits, int) or isinstance(value_bits, bool)
                or not MIN_VALUE_BITS <= value_bits <= MAX_VALUE_BITS):
            raise ValueError(f"value_bits must be an integer in [{MIN_VALUE_BITS}, {MAX_VALUE_BITS}], got {value_bits!r}")
        if not (isinstance(headroom, (int, float)) and math.isfinite(headroom) and headroom >= 0):
            raise ValueError(f"headroom must be a finite number >= 0, got {headroom!r}")
        if not isinstance(margin_bits, int) or isinstance(margin_bits, bool) or not 0 <= margin_bits <= 8:
            raise ValueError(f"margin_bits must be an integer in [0, 8], got {margin_bits!r}")
        if not isinstance(max_summands, int) or isinstance(max_summands, bool) or max_summands < 1:
            raise ValueError(f"max_summands must be an integer >= 1, got {max_summands!r}")
        scale = _largest_scale(float(value_range), 1, 1 << (value_bits - 1))
        span = float(value_range) + float(headroom)
        bits = (max_summands * math.ceil(span * scale)).bit_length() + 1 + margin_bits
        if bits > MAX_BITS:
            return cls.for_summands(span, max_summands, MAX_BITS)
        return cls(clip_range=span, bits=max(bits, 2), scale=scale, max_summands=max_summands)

    @property
    def sum_limit(self) -> int:
        """``2^(bits-1) - 1``: the largest |sum| the signed reading represents."""
        return (1 << (self.bits - 1)) - 1

    @property
    def q_max(self) -> int:
        """The largest |q| one quantised coordinate can take: ``ceil(clip_range * scale)``."""
        assert self.scale is not None
        return math.ceil(float(self.clip_range) * self.scale)

    @property
    def modulus(self) -> int:
        return 1 << self.bits


def _largest_scale(clip: float, summands: int, limit: int) -> float:
    per_summand = limit // summands  # >= 1, checked by the caller
    ratio = per_summand / clip
    if not (math.isfinite(ratio) and 2.0**-1000 < ratio < 2.0**1000):
        raise ValueError(f"clip_range {clip} is out of the representable range for {summands} summands")
    scale = 2.0 ** math.floor(math.log2(ratio))
    while summands * math.ceil(clip * scale) > limit:  # log2 rounding put it one power too high
        scale /= 2.0
    while summands * math.ceil(clip * scale * 2.0) <= limit:
        scale *= 2.0
    return scale


def encode(values: np.ndarray, spec: RingSpec, rng: np.random.Generator | KeystreamRandom | None) -> np.ndarray:
    """Clip, scale, round (stochastic with ``rng``, to nearest without) and map into Z_{2^bits} (uint32).

    ValueError for a non-finite value (NaN or inf is an error upstream, never clipped away) or an
    input that is not a one-dimensional real array.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"values must be one-dimensional, got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"values must be real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"values must be finite, got {arr[bad]} at position {bad}")
    assert spec.scale is not None
    a = np.clip(arr, -spec.clip_range, spec.clip_range) * spec.scale
    if rng is None:
        q = np.rint(a)
    else:
        q = np.floor(a)
        q += rng.random(a.shape) < (a - q)  # a - floor(a) is exact, so q <= ceil(a) <= q_max
    mask = np.int64(spec.modulus - 1)
    return (q.astype(np.int64) & mask).astype(np.uint32)


def decode_sum(ring_sum: np.ndarray, spec: RingSpec, count: int, strict: bool = True) -> np.ndarray:
    """The float sum of ``count`` encoded vectors from their ring sum (signed reading, divided by s).

    ValueError if ``count`` exceeds ``spec.max_summands`` (the sum could have wrapped) or, ``strict``, if a
    coordinate's magnitude exceeds ``count * q_max``, which no honest sum of ``count`` summands
    reaches (a wrong count or masks that did not cancel). Not ``strict``: the caller checks the range itself,
    after it has noised the sum (a check of the un-noised sum would publish a function of it).
    """
    arr = np.asarray(ring_sum)
    if arr.dtype != np.uint32 or arr.ndim != 1:
        raise ValueError(f"ring_sum must be a one-dimensional uint32 array, got {arr.dtype} {arr.shape}")
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= spec.max_summands:
        raise ValueError(f"count must be an integer in [0, max_summands={spec.max_summands}], got {count!r}")
    r = arr.astype(np.int64) & np.int64(spec.modulus - 1)
    signed = np.where(r > spec.sum_limit, r - np.int64(spec.modulus), r)
    bound = count * spec.q_max
    if strict and signed.size and int(np.abs(signed).max()) > bound:
        # no value or position of the sum in the message: it reaches the round's record, and the sum is the
        # devices' data (un-noised in central mode)
        raise ValueError(f"a coordinate of the ring sum exceeds what {count} summands can reach ({bound}): "
                         f"wrong count, or masks that did not cancel")
    assert spec.scale is not None
    return signed.astype(np.float64) / spec.scale
