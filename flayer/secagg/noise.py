"""Discrete Gaussian noise in the ring: distributed differential privacy under secure aggregation.

With secure aggregation the coordinator sees only the sum, so the noise can be added by the devices, in
shares, inside the ring (Kairouz, Liu, Steinke, ICML 2021, "The Distributed Discrete Gaussian Mechanism"):
each device adds integer noise from the discrete Gaussian ``N_Z(0, sigma^2)`` to its quantised values, and
the sum of the survivors' shares carries the noise of the whole round. Integers, because the masks cancel
only in modular arithmetic: a real-valued share would have to be rounded, which is not a mechanism with a
clean guarantee; the discrete Gaussian with integer sensitivity Delta satisfies the same bound as the
continuous one, ``(Delta / sigma)^2 / 2``-zCDP (Canonne, Kamath, Steinke, NeurIPS 2020, Thm. 4).

:func:`discrete_gaussian` is the exact sampler of Canonne et al. (Algorithm 3), vectorised: proposals from
the discrete Laplace distribution of scale ``t = floor(sigma) + 1``, each accepted with probability
``exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2))`` (in floating point, as common implementations do).
"""

from __future__ import annotations

import math

import numpy as np

from .prg import KeystreamRandom

__all__ = ["discrete_gaussian"]

MAX_SIGMA = 2.0**40  # int64 samples: 8 sigma stays far below 2^63


def _discrete_laplace(t: int, size: int, rng: np.random.Generator | KeystreamRandom) -> np.ndarray:
    """``P(y) ~ exp(-|y| / t)`` on the integers: the difference of two geometric variables."""
    p = -math.expm1(-1.0 / t)  # 1 - exp(-1/t), accurate for large t
    return rng.geometric(p, size).astype(np.int64) - rng.geometric(p, size).astype(np.int64)


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator | KeystreamRandom) -> np.ndarray:
    """``size`` samples of ``N_Z(0, sigma^2)``: ``P(x) ~ exp(-x^2 / (2 sigma^2))`` on the integers (int64).
    ``sigma = 0`` gives zeros; ValueError for a sigma that is negative, not finite or above 2^40."""
    if not (math.isfinite(sigma) and 0 <= sigma <= MAX_SIGMA):
        raise ValueError(f"sigma must be a finite number in [0, 2^40], got {sigma!r}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if sigma == 0 or size == 0:
        return np.zeros(size, dtype=np.int64)
    t = int(math.floor(sigma)) + 1
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        want = max(16, int((size - filled) * 1.6))  # acceptance is >= ~0.6 for sigma >= 1
        y = _discrete_laplace(t, want, rng)
        accept = rng.random(want) < np.exp(-((np.abs(y) - sigma * sigma / t) ** 2) / (2 * sigma * sigma))
        got = y[accept][: size - filled]
        out[filled:filled + got.size] = got
        filled += got.size
    return out
