"""Turning an attack's scores into privacy figures (docs/results/privacy-audit.md).

- :func:`epsilon_lower_bound`: Jagielski, Ullman and Oprea 2020 (arXiv 2006.07709), as Nasr et al. 2021
  (arXiv 2101.04535) use it. Any test that tells the two neighbouring worlds apart at false-positive rate FPR
  and false-negative rate FNR bounds an (epsilon, delta)-DP mechanism's epsilon from below by
  ``log((1 - delta - FNR) / FPR)`` and by ``log((1 - delta - FPR) / FNR)``. The rates are estimated from trials,
  so each is replaced by its Clopper-Pearson upper bound; the threshold is chosen on a calibration share of
  the trials and the bound is computed on the rest, so the choice costs no confidence (the stated confidence
  holds for the one rule certified).
- :func:`gaussian_pair_epsilon`: the epsilon at delta of telling two Gaussians apart, the form Andrew et al.
  2023 (arXiv 2302.03098) give their one-run estimate (canary cosines against the null's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["AuditBound", "clopper_pearson_upper", "epsilon_from_rates", "epsilon_lower_bound",
           "gaussian_pair_epsilon"]


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper-Pearson upper bound on a rate of which ``k`` of ``n`` trials hit, at level ``alpha``."""
    if not (0 <= k <= n and n >= 1 and 0 < alpha < 1):
        raise ValueError(f"need 0 <= k <= n, n >= 1 and 0 < alpha < 1, got k={k}, n={n}, alpha={alpha}")
    if k == n:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(1.0 - alpha, k + 1, n - k))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The larger of ``log((1 - delta - FNR) / FPR)`` and ``log((1 - delta - FPR) / FNR)`` (0 when neither is
    positive): the epsilon below which no (epsilon, delta)-DP mechanism lets a test reach these rates."""
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        num = 1.0 - delta - a
        if num > 0:
            best = max(best, math.inf if b <= 0 else math.log(num / b))
    return best


@dataclass(frozen=True)
class AuditBound:
    """An epsilon lower bound at ``confidence``, the rule it certifies and the trials it rests on."""

    epsilon: float  # the lower bound (0: the certified trials show nothing)
    threshold: float  # guess "canary in" when score >= threshold (``above``) or <= it
    above: bool
    fpr: float  # the certified trials' observed rates
    fnr: float
    fpr_upper: float  # their Clopper-Pearson upper bounds
    fnr_upper: float
    trials_in: int  # trials per world: calibration and certification together
    trials_out: int
    certified_in: int  # of which certify the rule
    certified_out: int
    confidence: float
    delta: float

    def as_dict(self) -> dict[str, float | int | bool]:
        return dict(self.__dict__)


def _counts(scores_in: np.ndarray, scores_out: np.ndarray, t: float, above: bool) -> tuple[int, int]:
    """(false positives among the out-world scores, false negatives among the in-world scores)."""
    if above:
        return int(np.count_nonzero(scores_out >= t)), int(np.count_nonzero(scores_in < t))
    return int(np.count_nonzero(scores_out <= t)), int(np.count_nonzero(scores_in > t))


def _cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """:func:`clopper_pearson_upper` of every count in ``k`` at once."""
    from scipy.stats import beta

    k = np.asarray(k)
    out = np.ones(k.shape, dtype=np.float64)
    inside = k < n
    out[inside] = beta.ppf(1.0 - alpha, k[inside] + 1, n - k[inside])
    return out


def _rates_epsilon(fpr: np.ndarray, fnr: np.ndarray, delta: float) -> np.ndarray:
    """:func:`epsilon_from_rates` over arrays."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(1.0 - delta - fnr > 0, np.log(np.maximum(1.0 - delta - fnr, 1e-300) / fpr), 0.0)
        b = np.where(1.0 - delta - fpr > 0, np.log(np.maximum(1.0 - delta - fpr, 1e-300) / fnr), 0.0)
    return np.maximum(0.0, np.maximum(a, b))


def _thresholds(cal: np.ndarray, candidates: int | None) -> np.ndarray:
    """Midpoints between the calibration scores (every one, or ``candidates`` of them spaced geometrically from
    both ends, where a test's power at small error rates lives), and one beyond each end."""
    values = np.unique(cal)
    mids = (values[:-1] + values[1:]) / 2
    if candidates is not None and mids.size > candidates:
        half = np.unique(np.geomspace(1, mids.size, max(2, candidates // 2)).astype(np.int64) - 1)
        mids = mids[np.unique(np.concatenate([half, mids.size - 1 - half]))]
    return np.concatenate([[values[0] - 1.0], mids, [values[-1] + 1.0]])


def epsilon_lower_bound(scores_in: Sequence[float], scores_out: Sequence[float], delta: float,
                        confidence: float = 0.95, calibrate: float = 0.5,
                        candidates: int | None = None) -> AuditBound:
    """Epsilon lower bound from an attack's scores in trials with the canary (``scores_in``) and without it
    (``scores_out``), both independent trials of the same mechanism. The first ``calibrate`` share of each
    list chooses the threshold and its side (the rule whose bound on those trials is highest; ``candidates``:
    how many thresholds are tried, None for every midpoint); the rest certify it: with probability at least
    ``confidence`` both certified rates are below their one-sided Clopper-Pearson bounds (each at level
    ``(1 - confidence) / 2``), and then the epsilon returned is a lower bound on the mechanism's."""
    sin, sout = np.asarray(scores_in, dtype=np.float64), np.asarray(scores_out, dtype=np.float64)
    if not (0 < delta < 1 and 0 < confidence < 1 and 0 < calibrate < 1):
        raise ValueError(f"need delta, confidence and calibrate in (0, 1), got {delta}, {confidence}, {calibrate}")
    if not (np.isfinite(sin).all() and np.isfinite(sout).all()):
        raise ValueError("scores must be finite")
    ci, co = int(len(sin) * calibrate), int(len(sout) * calibrate)
    if min(ci, co, len(sin) - ci, len(sout) - co) < 1:
        raise ValueError(f"need trials to calibrate and to certify in both worlds, got {len(sin)} and {len(sout)}")
    alpha = (1.0 - confidence) / 2
    cal_in, cal_out, cert_in, cert_out = sin[:ci], sout[:co], sin[ci:], sout[co:]
    ts = _thresholds(np.concatenate([cal_in, cal_out]), candidates)
    sorted_in, sorted_out = np.sort(cal_in), np.sort(cal_out)
    # above: guess "in" when score >= t: FP = out-scores >= t, FN = in-scores < t; below: the mirror
    below_in = np.searchsorted(sorted_in, ts, side="left")  # in-scores < t
    below_out = np.searchsorted(sorted_out, ts, side="left")
    upto_in = np.searchsorted(sorted_in, ts, side="right")  # in-scores <= t
    upto_out = np.searchsorted(sorted_out, ts, side="right")
    eps_above = _rates_epsilon(_cp_upper(co - below_out, co, alpha), _cp_upper(below_in, ci, alpha), delta)
    eps_below = _rates_epsilon(_cp_upper(upto_out, co, alpha), _cp_upper(ci - upto_in, ci, alpha), delta)
    rules = [(float(e), float(t), True) for e, t in zip(eps_above, ts)] + \
        [(float(e), float(t), False) for e, t in zip(eps_below, ts)]
    top = max(r[0] for r in rules)
    ties = [r for r in rules if r[0] >= top - 1e-12]
    _, t, above = ties[len(ties) // 2]  # the middle of the best range: the margin on both sides
    fp, fn = _counts(cert_in, cert_out, t, above)
    n_in, n_out = len(cert_in), len(cert_out)
    fpr_hi, fnr_hi = clopper_pearson_upper(fp, n_out, alpha), clopper_pearson_upper(fn, n_in, alpha)
    return AuditBound(epsilon_from_rates(fpr_hi, fnr_hi, delta), t, above, fp / n_out, fn / n_in, fpr_hi, fnr_hi,
                      len(sin), len(sout), n_in, n_out, confidence, delta)


def _pair_delta(eps: float, x: np.ndarray, logp: np.ndarray, logq: np.ndarray, dx: float) -> float:
    """The hockey-stick divergence ``int max(0, p - e^eps q)`` on the grid ``x``."""
    p = np.exp(logp)
    return float(np.sum(p * -np.expm1(np.minimum(0.0, eps + logq - logp))) * dx)


def gaussian_pair_epsilon(mu0: float, sd0: float, mu1: float, sd1: float, delta: float) -> float:
    """The smallest epsilon at which N(mu1, sd1^2) and N(mu0, sd0^2) are (epsilon, delta)-indistinguishable both
    ways (numerical integration on a grid of 400,001 points; equal variances have a closed form, which
    this agrees with). inf when a standard deviation is 0 and the means differ."""
    if not (sd0 >= 0 and sd1 >= 0 and 0 < delta < 1):
        raise ValueError(f"need standard deviations >= 0 and 0 < delta < 1, got {sd0}, {sd1}, {delta}")
    if min(sd0, sd1) <= 0:
        return 0.0 if mu0 == mu1 and sd0 == sd1 else math.inf
    lo_x = min(mu0 - 40 * sd0, mu1 - 40 * sd1)
    hi_x = max(mu0 + 40 * sd0, mu1 + 40 * sd1)
    x, dx = np.linspace(lo_x, hi_x, 400_001, retstep=True)

    def logpdf(mu: float, sd: float) -> np.ndarray:
        return -0.5 * ((x - mu) / sd) ** 2 - math.log(sd * math.sqrt(2 * math.pi))

    l0, l1 = logpdf(mu0, sd0), logpdf(mu1, sd1)

    def worst(eps: float) -> float:
        return max(_pair_delta(eps, x, l1, l0, dx), _pair_delta(eps, x, l0, l1, dx))

    if worst(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while worst(hi) > delta:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            return math.inf
    while hi - lo > 1e-4 * max(1.0, hi):
        mid = (lo + hi) / 2
        if worst(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi
