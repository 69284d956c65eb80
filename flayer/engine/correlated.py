"""Correlated noise for central-DP rounds: a banded Toeplitz matrix factorization (docs/explanation/privacy.md,
"Correlated noise").

Independent noise adds ``N(0, (z C)^2)`` to every round's sum, so the model after t rounds carries the sum of t
independent draws (variance ``t (z C)^2``). DP-MF (Choquette-Choo et al., "Amplified banded matrix
factorization", NeurIPS 2023; McKenna et al. 2024, the banded Toeplitz strategies jax-privacy optimises) adds
instead ``w = C^{-1} z``: the run releases ``x + C^{-1} z`` for the rounds' sums ``x``, post-processing of
``C x + z``. Here ``C`` is lower-triangular, Toeplitz and banded: ``C[t, t-i] = c_i`` for ``0 <= i < bands``,
with ``sum_i c_i^2 = 1``. Round t's noise solves ``C w = z`` row by row::

    w_t = (z_t - sum_{i=1}^{bands-1} c_i w_{t-i}) / c_0,     z_t ~ N(0, (z C)^2) per coordinate

so the stream's state is the last ``bands - 1`` noise vectors (:class:`BandedNoise`), and the ``w_t`` are
negatively correlated: their prefix sums -- what a model accumulates -- carry less noise than independent draws.

**Sensitivity.** Under the participation schema (each device in at most k rounds, ``min_separation`` b apart;
:class:`flayer.privacy_config.ParticipationSchema`) with ``bands <= b``, the columns of C that one device's
rounds touch have disjoint supports, so ``||C u||^2 = sum_t ||C[:, t]||^2 ||u_t||^2 <= k C^2``
(:func:`minsep_sensitivity_squared`: the unit-norm columns make it exactly k, as for independent noise). The
whole run is then one Gaussian mechanism of multiplier ``z / sqrt(k)``, the k-fold composition at q = 1 the
accountant already books for the schema (:mod:`flayer.engine.accountant`, ``most = k``). Without a schema, or
with ``bands > min_separation``, the columns overlap and that figure does not hold: refused
(:meth:`flayer.privacy_config.PrivacySettings.correlated_problem`).

The coefficients minimise the mean squared error of the prefix sums times the sensitivity
(:func:`optimize_banded`, L-BFGS on ``bands`` variables); ``tests/flayer/test_correlated.py`` checks them and
the sensitivity against jax-privacy 2.0's ``optimize_banded_toeplitz`` and ``minsep_sensitivity_squared``.

**The noise state is a secret.** Whoever holds the last ``bands - 1`` noise vectors subtracts part of the next
round's noise from the published model. It lives only in the driver's memory (``flayer simulate``) or in a
0600 file of a private state folder (:meth:`BandedNoise.save`, :func:`flayer.files.atomic_write`); a plan
names only the kind, the bands and a digest of the coefficients (:func:`plan_fields`).
"""

from __future__ import annotations

import hashlib
import io
import math
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flayer.files import atomic_write
from flayer.privacy_config import MAX_BANDS

__all__ = ["MAX_BANDS", "BandedNoise", "NoiseStateError", "coefficients",
           "coefficients_digest", "minsep_sensitivity_squared", "optimize_banded", "plan_fields",
           "prefix_errors"]

NORM_TOLERANCE = 1e-9  # the coefficients' L2 norm is 1 to float rounding (the accountant's z assumes it)


class NoiseStateError(ValueError):
    """A saved noise state is malformed or does not belong to this run's strategy."""


class Normal(Protocol):
    def normal(self, loc: float = ..., scale: float = ..., size: Any = ...) -> Any: ...


def _inverse(coef: np.ndarray, n: int) -> np.ndarray:
    """The first column of ``C^{-1}`` (n entries): ``d_0 = 1 / c_0``, ``d_j = -sum_i c_i d_{j-i} / c_0``."""
    from scipy.signal import lfilter

    impulse = np.zeros(n)
    impulse[0] = 1.0
    return np.asarray(lfilter([1.0], coef, impulse), dtype=np.float64)


def prefix_errors(coef: np.ndarray | list[float], n: int) -> np.ndarray:
    """Per-round squared error of the prefix sums under strategy ``coef`` at unit noise: row norms of
    ``A C^{-1}`` with A the prefix-sum workload (jax-privacy's ``per_query_error``). Independent noise
    (``coef = [1]``): ``1, 2, ..., n``."""
    e = np.cumsum(_inverse(np.asarray(coef, dtype=np.float64), n))
    return np.cumsum(e * e)


def _loss(coef: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """Mean prefix-sum error times ``||c||^2`` (the sensitivity's scale) and its gradient in ``coef``."""
    d = _inverse(coef, n)
    e = np.cumsum(d)
    w = (n - np.arange(n)) / n  # round j's error term enters the prefix sums of rounds j..n-1
    err = float(np.sum(w * e * e))
    dd = np.convolve(d, d)[:n]  # d C^{-1} / d c_i applied to e_0: -shift_i(d * d)
    grad_err = np.empty(coef.size)
    for i in range(coef.size):
        de = -np.cumsum(np.concatenate([np.zeros(i), dd[:n - i]]))
        grad_err[i] = float(np.sum(2 * w * e * de))
    s = float(coef @ coef)
    return err * s, grad_err * s + err * 2 * coef


def optimize_banded(n: int, bands: int) -> np.ndarray:
    """The ``bands`` coefficients (unit L2 norm, ``c_0 > 0``) of the banded Toeplitz strategy that minimises the
    mean prefix-sum error over ``n`` rounds at a fixed sensitivity; started from the Toeplitz square root of the
    prefix-sum matrix (``c_i = binom(2i, i) / 4^i``), as jax-privacy starts."""
    from scipy.optimize import minimize

    if not (isinstance(n, int) and isinstance(bands, int) and 1 <= bands <= MAX_BANDS and n >= 1):
        raise ValueError(f"need rounds n >= 1 and 1 <= bands <= {MAX_BANDS}, got n={n!r}, bands={bands!r}")
    bands = min(bands, n)
    x0 = np.array([math.comb(2 * i, i) / 4.0 ** i for i in range(bands)])
    if bands == 1:
        return np.array([1.0])
    res = minimize(_loss, x0, args=(n,), jac=True, method="L-BFGS-B", options={"maxiter": 500, "gtol": 1e-12,
                                                                               "ftol": 1e-15})
    c = np.asarray(res.x, dtype=np.float64)
    c = c / np.linalg.norm(c)
    return -c if c[0] < 0 else c


_CACHE: dict[tuple[int, int], np.ndarray] = {}


def coefficients(n: int, bands: int) -> np.ndarray:
    """:func:`optimize_banded`, memoised (a copy)."""
    if (n, bands) not in _CACHE:
        _CACHE[(n, bands)] = optimize_banded(n, bands)
    return _CACHE[(n, bands)].copy()


def minsep_sensitivity_squared(coef: np.ndarray | list[float], min_sep: int, most: int, n: int) -> float:
    """``max ||C u||^2`` over a device's participations -- at most ``most`` rounds of ``n``, ``min_sep`` apart,
    each ``||u_t|| <= 1`` -- for ``bands <= min_sep`` (disjoint column supports: the sum of the ``most``
    largest reachable column norms; a column's norm only shrinks towards the end, so rounds 0, b, 2b, ...).
    ValueError where the columns of one device's rounds could overlap."""
    c = np.asarray(coef, dtype=np.float64)
    if c.size > max(1, min_sep):
        raise ValueError(f"bands {c.size} > min_separation {min_sep}: one device's rounds share rows of the strategy, "
                         f"and its sensitivity is not the sum of its columns'")
    tail = np.cumsum((c * c)[::-1])[::-1]  # column t's norm^2 = sum_{i < min(bands, n - t)} c_i^2
    cols = [float(tail[max(0, c.size - (n - t))]) for t in range(0, n, max(1, min_sep))][:most]
    return float(sum(cols))


def coefficients_digest(coef: np.ndarray) -> str:
    """SHA-256 of the coefficients as little-endian float64 (the plan's ``noise_digest``)."""
    return hashlib.sha256(np.asarray(coef, dtype="<f8").tobytes()).hexdigest()


def plan_fields(coef: np.ndarray) -> dict[str, Any]:
    """What a plan says of the noise: its kind, bands and the coefficients' digest -- never the state."""
    return {"noise": "banded", "bands": int(coef.size), "noise_digest": coefficients_digest(coef)}


class BandedNoise:
    """The streaming generator of banded noise over a model of ``dim`` coordinates (module docstring). ``std``:
    ``z C``, the std of each ``z_t``; :meth:`draw` takes ``z_t`` from a CSPRNG (the project's
    :class:`flayer.secagg.prg.KeystreamRandom`) and returns ``w_t``; the state is the last ``bands - 1`` noise
    vectors and the count of rounds drawn."""

    def __init__(self, coef: np.ndarray, std: float, dim: int) -> None:
        coef = np.asarray(coef, dtype=np.float64)
        if coef.ndim != 1 or not 1 <= coef.size <= MAX_BANDS or not coef[0] > 0 \
                or abs(float(np.linalg.norm(coef)) - 1.0) > NORM_TOLERANCE or not np.isfinite(coef).all():
            raise ValueError(f"banded noise needs 1 to {MAX_BANDS} finite coefficients of unit norm with c_0 > 0")
        if not (math.isfinite(std) and std >= 0) or dim < 1:
            raise ValueError(f"need a finite std >= 0 and dim >= 1, got {std}, {dim}")
        self.coef, self.std, self.dim = coef, float(std), int(dim)
        self.history: list[np.ndarray] = []  # newest first, at most bands - 1
        self.step = 0

    def draw(self, rng: Normal) -> np.ndarray:
        """Round ``step + 1``'s noise ``w_t`` (float64, ``dim``); advances the state."""
        z = np.array(rng.normal(0.0, self.std, self.dim), dtype=np.float64) if self.std > 0 else np.zeros(self.dim)
        for c, prev in zip(self.coef[1:], self.history):
            z -= c * prev
        w = z / self.coef[0]
        self.history = [w, *self.history][: self.coef.size - 1]
        self.step += 1
        return w

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        hist = np.stack(self.history) if self.history else np.zeros((0, self.dim))
        np.savez(buf, coef=self.coef, std=np.float64(self.std), step=np.int64(self.step), history=hist)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, raw: bytes, coef: np.ndarray, std: float, dim: int) -> BandedNoise:
        """A saved state, checked against the run's ``coef``, ``std`` and ``dim``; NoiseStateError otherwise."""
        try:
            with np.load(io.BytesIO(raw), allow_pickle=False) as f:
                saved, s, step, hist = f["coef"], float(f["std"]), int(f["step"]), np.asarray(f["history"], np.float64)
        except (OSError, ValueError, KeyError, EOFError) as exc:
            raise NoiseStateError(f"noise state: unreadable ({exc})") from None
        if saved.shape != np.shape(coef) or not np.array_equal(saved, coef) or s != std:
            raise NoiseStateError("noise state: saved for other coefficients or another noise std")
        if hist.ndim != 2 or hist.shape[1] != dim or hist.shape[0] != min(step, len(coef) - 1) \
                or not np.isfinite(hist).all() or step < 0:
            raise NoiseStateError(f"noise state: history of shape {hist.shape} does not fit step {step}, dim {dim}")
        out = cls(coef, std, dim)
        out.history, out.step = list(hist), step
        return out

    def save(self, path: str | Path) -> Path:
        """Write the state to ``path`` (0600, atomically: :func:`flayer.files.atomic_write`)."""
        return atomic_write(path, self.to_bytes(), 0o600)

    @classmethod
    def load(cls, path: str | Path, coef: np.ndarray, std: float, dim: int) -> BandedNoise:
        return cls.from_bytes(Path(path).read_bytes(), coef, std, dim)
