"""The privacy accountant: epsilon spent at delta over the rounds of a private federation.

Composition is not written here: it is Opacus's Renyi-DP accountant (``opacus.accountants.RDPAccountant``:
the Poisson-subsampled Gaussian mechanism of Mironov et al. 2019, composed over rounds, converted to
(epsilon, delta) with Balle et al. 2020's bound), a maintained library. Google's ``dp-accounting`` was
the first choice; it pins ``attrs<24``, which the ExecuTorch export's ``cattrs`` (``attrs>=25.4``) cannot
share an environment with, so the project takes the other accountant the issue names.

What one round is, for the accountant (docs/explanation/privacy.md):

- **Synchronous rounds**: one Poisson-subsampled Gaussian mechanism with noise multiplier ``z`` and
  sampling rate ``q = asked / N``, ``asked`` the devices the round selects (over-selection included) and
  ``N`` the population. The selection is fixed-size and seeded, not Poisson; the rate is the share a
  round asks, the largest probability any device has of contributing. Dropouts only lower the true
  rate, and the fixed denominator keeps each device's share bounded by C whoever drops out, so the rate
  over-states (never under-states) a device's exposure. Treating fixed-size sampling as Poisson at its
  mean rate is the convention of DP-FedAvg's deployments (McMahan et al. 2018); it is an assumption,
  stated where epsilon is shown.
- **Asynchronous rounds**: which devices land in a buffer depends on their speed, not on a random draw,
  so no amplification by sampling is claimed: every model version is composed at ``q = 1`` (each device
  contributes at most one update per version), which is conservative.

:class:`Ledger` keeps the composed history as ``(z, q, rounds)`` runs -- exactly what a checkpoint stores
-- so a restarted coordinator recomposes the same epsilon, neither forgetting nor double-counting.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Ledger", "LedgerError", "epsilon_for", "noise_for_target", "rounds_for_target"]


class LedgerError(ValueError):
    """A ledger's saved state is malformed."""


@functools.lru_cache(maxsize=256)
def _step_rdp(z: float, q: float) -> tuple[float, ...]:
    """RDP of one round at (z, q) over Opacus's default orders (``compute_rdp``; a run of n rounds is n
    times this: RDP composes additively, which is what ``RDPAccountant`` sums too). Cached: the subsampled
    series costs a fraction of a second per (z, q), and a federation repeats the same pair every round."""
    from opacus.accountants import RDPAccountant  # the server's extra; devices never import it
    from opacus.accountants.analysis.rdp import compute_rdp

    return tuple(float(v) for v in compute_rdp(q=q, noise_multiplier=z, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


def epsilon_for(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` of the composed ``(z, q, rounds)`` runs (inf when a run has no noise): the runs'
    RDP summed, converted by Opacus's ``get_privacy_spent`` (Balle et al. 2020), as ``RDPAccountant`` does."""
    if not history:
        return 0.0
    if any(z <= 0 for z, q, n in history if n > 0 and q > 0):
        return math.inf
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    rdp = np.zeros(len(RDPAccountant.DEFAULT_ALPHAS))
    for z, q, n in history:
        rdp += n * np.array(_step_rdp(float(z), float(q)))
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound is valid, only looser
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


@dataclass
class Ledger:
    """The rounds composed so far, as ``(z, q, rounds)`` runs in order."""

    history: list[tuple[float, float, int]] = field(default_factory=list)

    def compose(self, z: float, q: float, rounds: int = 1) -> None:
        if not (0 < q <= 1) or rounds < 1 or z < 0:
            raise ValueError(f"need 0 < q <= 1, rounds >= 1 and z >= 0, got q={q}, rounds={rounds}, z={z}")
        if self.history and self.history[-1][:2] == (z, q):
            self.history[-1] = (z, q, self.history[-1][2] + rounds)
        else:
            self.history.append((float(z), float(q), int(rounds)))

    @property
    def rounds(self) -> int:
        return sum(n for _, _, n in self.history)

    def epsilon(self, delta: float) -> float:
        return epsilon_for(self.history, delta)

    def epsilon_after(self, z: float, q: float, delta: float, rounds: int = 1) -> float:
        """Epsilon if ``rounds`` more rounds at (z, q) were composed (the ledger is left as it is)."""
        nxt = Ledger(list(self.history))
        nxt.compose(z, q, rounds)
        return nxt.epsilon(delta)

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


def noise_for_target(target_epsilon: float, delta: float, q: float, rounds: int) -> float:
    """The smallest noise multiplier z whose ``rounds`` rounds at rate q stay within ``target_epsilon``
    (Opacus's ``get_noise_multiplier``, a bisection on the same accountant)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=q,
                                          steps=rounds, accountant="rdp", epsilon_tolerance=0.005))


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
