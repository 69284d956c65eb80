"""The privacy accountant: epsilon spent at delta over the rounds of a private federation.

What one round is, for the accountant (docs/explanation/privacy.md, "Who learns what"):

- **The cohort is public.** Every round plan lists ``selected`` (devices and anyone on the broker read it),
  and the coordinator and the simulator draw the cohort from a seed that plans carry. No adversary is
  therefore uncertain about who took part, so no amplification by sampling is claimed: each round is a
  Gaussian mechanism of multiplier ``z`` (sensitivity C, one device's clipped upload) composed at
  ``q = 1``, which bounds the epsilon of a device that took part in every round. A device that took
  part in fewer rounds spent less (the device itself counts them).
- **Composition at q = 1 is exact.** ``T`` Gaussian mechanisms of multipliers ``z_i`` are together one
  Gaussian mechanism of multiplier ``(sum_i z_i^-2)^(-1/2)`` (Dong, Roth and Su 2019, Gaussian DP), whose
  (epsilon, delta) curve has a closed form (Balle and Wang 2018, Thm 8):
  ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` with ``mu = 1/z``. This is what
  :func:`epsilon_for` computes for ``q = 1`` runs: tight, no discretisation, no library needed (a device
  can compute its own epsilon). Google's ``dp-accounting`` (its privacy-loss-distribution accountant, PLD)
  agrees within its discretisation; ``tests/flayer/test_accountant.py`` checks both against it.
- **Sampling, only where it is secret.** :func:`epsilon_for` also composes Poisson-sampled runs
  (``q < 1``) with ``dp-accounting``'s PLD accountant, and :func:`epsilon_fixed_size` a fixed-size cohort
  drawn without replacement (``dp-accounting``'s RDP accountant, replace-one neighbours: the relation a
  fixed-size sample supports). Neither is what this release's selection offers any adversary;
  ``flayer simulate --dp-plan`` prints them as what a secret selection would give, labelled so.

- **A participation schema bounds each device's rounds.** With ``[privacy] max_participations = k`` the
  selection names a device in at most k cohorts (:mod:`flayer.engine.selection`), and a round a device is not
  in does not depend on its data (the cohort is drawn from public facts; under the zero-out relation its
  neighbour is in the same cohorts). Its epsilon is then at most the composition of the k rounds of the
  history with the least noise (``most = k`` below): every round at ``q = 1``, the precisions ``z^-2`` of at
  most k rounds add up to at most those of the k largest. At a fixed z that is k-fold composition, however
  many rounds run.

:class:`Ledger` keeps the composed history as ``(z, q, rounds)`` runs -- exactly what a checkpoint stores
-- so a restarted coordinator recomposes the same epsilon, neither forgetting nor double-counting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ledger", "LedgerError", "epsilon_fixed_size", "epsilon_for", "gaussian_epsilon", "noise_for_target",
           "rounds_for_target", "worst_rounds"]


class LedgerError(ValueError):
    """A ledger's saved state is malformed."""


def _log_phi(x: float) -> float:
    """log of the standard normal CDF at ``x``, accurate far into the lower tail."""
    try:
        from scipy.special import log_ndtr

        return float(log_ndtr(x))
    except ImportError:  # a device without scipy: erfc, then the tail's asymptotic series
        if x > -30:
            v = 0.5 * math.erfc(-x / math.sqrt(2))
            return math.log(v) if v > 0 else -math.inf
        return -x * x / 2 - math.log(-x * math.sqrt(2 * math.pi)) + math.log1p(-1 / (x * x))


def _gaussian_delta(eps: float, mu: float) -> float:
    """delta(eps) of a Gaussian mechanism with ``mu`` = sensitivity / std (Balle and Wang 2018, Thm 8)."""
    a, b = _log_phi(-eps / mu + mu / 2), eps + _log_phi(-eps / mu - mu / 2)
    return math.exp(a) - math.exp(b) if a > b else 0.0


def gaussian_epsilon(z: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of one Gaussian mechanism of multiplier ``z`` (std / sensitivity)."""
    if z <= 0:
        return math.inf
    mu = 1.0 / z
    if _gaussian_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _gaussian_delta(hi, mu) > delta:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return math.inf
    for _ in range(200):  # bisection to machine precision: delta(eps) decreases in eps
        mid = (lo + hi) / 2
        if _gaussian_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return hi


def _pld_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """dp-accounting's PLD accountant over runs with sampling (``q < 1``: Poisson, add/remove neighbours)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant()
    for z, q, n in history:
        event: Any = dp_accounting.GaussianDpEvent(z)
        if q < 1:
            event = dp_accounting.PoissonSampledDpEvent(q, event)
        acc.compose(dp_accounting.SelfComposedDpEvent(event, n))
    return float(acc.get_epsilon(delta))


def worst_rounds(history: Sequence[tuple[float, float, int]], most: int) -> list[tuple[float, float, int]]:
    """The ``most`` rounds of ``history`` with the smallest multipliers, as runs: what a device the schema
    names in at most ``most`` rounds can have been in at worst (module docstring). Rounds at ``q = 1`` only."""
    if any(q < 1 for _, q, n in history if n > 0):
        raise ValueError("a participation schema composes rounds at q = 1 only")
    out: list[tuple[float, float, int]] = []
    left = most
    for z, q, n in sorted(((float(z), float(q), int(n)) for z, q, n in history if n > 0), key=lambda r: r[0]):
        if left <= 0:
            break
        out.append((z, q, min(n, left)))
        left -= min(n, left)
    return out


def epsilon_for(history: Sequence[tuple[float, float, int]], delta: float, most: int | None = None) -> float:
    """Epsilon at ``delta`` of the composed ``(z, q, rounds)`` runs (inf when a run has no noise): all at
    ``q = 1``, the exact Gaussian composition (module docstring); with sampled runs, dp-accounting's PLD.
    ``most``: a device is in at most that many of the rounds (the participation schema; :func:`worst_rounds`)."""
    if most is not None:
        history = worst_rounds(history, most)
    runs = [(float(z), float(q), int(n)) for z, q, n in history if n > 0]
    if not runs:
        return 0.0
    if any(z <= 0 for z, _, _ in runs):
        return math.inf
    if all(q >= 1 for _, q, _ in runs):
        if any(z * z == 0.0 for z, _, _ in runs):  # a multiplier so small its square underflows: no noise
            return math.inf
        precision = sum(n / (z * z) for z, _, n in runs)
        return math.inf if not math.isfinite(precision) else gaussian_epsilon(precision ** -0.5, delta)
    return _pld_epsilon(runs, delta)


def epsilon_fixed_size(population: int, cohort: int, z: float, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` of ``rounds`` rounds that each draw a secret cohort of ``cohort`` of ``population``
    without replacement: dp-accounting's RDP accountant under replace-one neighbours (a device's data
    swapped for another's; the relation :class:`dp_accounting.SampledWithoutReplacementDpEvent` holds for)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    if z <= 0:
        return math.inf
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(population, cohort, dp_accounting.GaussianDpEvent(z))
    return float(acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds)).get_epsilon(delta))


@dataclass
class Ledger:
    """The rounds composed so far, as ``(z, q, rounds)`` runs in order."""

    history: list[tuple[float, float, int]] = field(default_factory=list)

    def compose(self, z: float, q: float = 1.0, rounds: int = 1) -> None:
        if not (0 < q <= 1) or rounds < 1 or z < 0:
            raise ValueError(f"need 0 < q <= 1, rounds >= 1 and z >= 0, got q={q}, rounds={rounds}, z={z}")
        if self.history and self.history[-1][:2] == (z, q):
            self.history[-1] = (z, q, self.history[-1][2] + rounds)
        else:
            self.history.append((float(z), float(q), int(rounds)))

    @property
    def rounds(self) -> int:
        return sum(n for _, _, n in self.history)

    def epsilon(self, delta: float, most: int | None = None) -> float:
        """``most``: a device is in at most that many rounds (the participation schema)."""
        return epsilon_for(self.history, delta, most)

    def epsilon_after(self, z: float, q: float, delta: float, rounds: int = 1, most: int | None = None) -> float:
        """Epsilon if ``rounds`` more rounds at (z, q) were composed (the ledger is left as it is)."""
        nxt = Ledger(list(self.history))
        nxt.compose(z, q, rounds)
        return nxt.epsilon(delta, most)

    def state(self) -> list[list[float]]:
        """JSON for a checkpoint: ``[[z, q, rounds], ...]``."""
        return [[z, q, n] for z, q, n in self.history]

    @classmethod
    def from_state(cls, raw: Iterable[Any]) -> Ledger:
        out: list[tuple[float, float, int]] = []
        for item in raw:
            if not (isinstance(item, (list, tuple)) and len(item) == 3
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item)):
                raise LedgerError(f"privacy ledger: each entry must be [z, q, rounds], got {item!r}")
            z, q, n = float(item[0]), float(item[1]), item[2]
            if not (z >= 0 and 0 < q <= 1 and isinstance(n, int) and n >= 1):
                raise LedgerError(f"privacy ledger: entry out of range: {item!r}")
            out.append((z, q, n))
        return cls(out)


def noise_for_target(target_epsilon: float, delta: float, q: float, rounds: int, most: int | None = None) -> float:
    """The smallest noise multiplier z (to 0.1%) whose ``rounds`` rounds at rate q stay within
    ``target_epsilon`` (a bisection on :func:`epsilon_for`); ``most``: a device is in at most that many of them
    (the participation schema: ``min(rounds, most)``-fold composition at q = 1)."""
    if not (target_epsilon > 0 and rounds >= 1):
        raise ValueError(f"need target_epsilon > 0 and rounds >= 1, got {target_epsilon}, {rounds}")
    if most is not None:
        if q < 1 or most < 1:
            raise ValueError(f"a participation schema needs q = 1 and max_participations >= 1, got q={q}, {most}")
        rounds = min(rounds, most)
    lo, hi = 0.0, 1.0
    while epsilon_for([(hi, q, rounds)], delta) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon:g} at delta {delta:g}")
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if epsilon_for([(mid, q, rounds)], delta) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def rounds_for_target(target_epsilon: float, delta: float, q: float, z: float, limit: int = 1_000_000) -> int:
    """The most rounds at (z, q) whose epsilon stays within ``target_epsilon`` (0: not even one)."""
    if epsilon_for([(z, q, 1)], delta) > target_epsilon:
        return 0
    lo, hi = 1, 2
    while hi <= limit and epsilon_for([(z, q, hi)], delta) <= target_epsilon:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # epsilon(lo) <= target < epsilon(hi)
        mid = (lo + hi) // 2
        if epsilon_for([(z, q, mid)], delta) <= target_epsilon:
            lo = mid
        else:
            hi = mid
    return lo
