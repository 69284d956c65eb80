"""The two audits of a private federation (docs/results/privacy-audit.md).

- :func:`audit_trials`: many runs of a small federation with and without one canary device (the canary's
  upload ``C u`` or a zero upload), each adversary's score per run, and from them an epsilon lower bound at
  a stated confidence (:func:`flayer.audit.bounds.epsilon_lower_bound`; Jagielski et al. 2020, Nasr et al.
  2021). A lower bound above the accountant's epsilon proves the mechanism or the accountant wrong.
- :func:`one_run_estimate`: one run with many random canary devices (Andrew et al. 2023, arXiv 2302.03098):
  the cosine between each canary's direction and the final model's change, against the null of directions
  that took no part (the cosine of a uniform direction with any fixed vector has mean 0 and variance 1/d).
  The estimate is the epsilon at delta of the Gaussian mechanism whose shift is the canaries' mean cosine in
  units of the null's standard deviation, ``mu = mean sqrt(d)`` (Andrew et al.'s Gaussian model with the
  canaries' spread equal to the null's, which high dimension gives); the fit with the canaries' own
  standard deviation is reported too, and with tens of canaries its tail makes it far noisier. An
  estimate, not a bound: it carries no confidence, and for the Gaussian mechanism it approaches the true
  epsilon as the number of canaries and the dimension grow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .bounds import AuditBound, epsilon_lower_bound, gaussian_pair_epsilon
from .canary import (
    ADVERSARIES,
    AuditFederation,
    adversary_vectors,
    digits_clients,
    initial_state,
    model_dim,
    random_directions,
    run_federation,
    scores,
)

__all__ = ["OneRunEstimate", "TrialAudit", "audit_trials", "one_run_estimate"]


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread while the audit runs (its models are tiny: more threads only contend)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class TrialAudit:
    """The many-run audit's result: the accountant's epsilon and each adversary's lower bound."""

    federation: AuditFederation
    accountant: float
    bounds: dict[str, AuditBound]
    scores_in: dict[str, list[float]]
    scores_out: dict[str, list[float]]


def audit_trials(fed: AuditFederation, trials: int, seed: int = 0, confidence: float = 0.95,
                 seeded_noise: bool = False, progress: Callable[[int], None] | None = None,
                 calibrate: float = 0.3, samples: int = 200) -> TrialAudit:
    """``trials`` runs with the canary and ``trials`` without, each with its own run seed (``seed`` onwards);
    the model's initialisation and the canary's direction are fixed (the auditor chooses them), so the runs
    differ in the mechanism's noise and the training's shuffling alone. ``seeded_noise``: run ``simulate``'s
    labelled not-private mode (the noise drawn from the run seed that plans carry). ``calibrate``: the share
    of each world's trials that chooses the threshold; ``samples``: digits images shared by the trainers."""
    if fed.canaries != 1:
        raise ValueError(f"the many-run audit uses one canary device, got {fed.canaries}")
    if trials < 4:
        raise ValueError(f"need at least 4 trials per world, got {trials}")
    datas = digits_clients(fed.trainers, seed, samples)
    g0 = initial_state(seed)
    u = random_directions(1, model_dim(g0), np.random.default_rng(seed))
    canary = fed.trainers
    s_in: dict[str, list[float]] = {a: [] for a in ADVERSARIES}
    s_out: dict[str, list[float]] = {a: [] for a in ADVERSARIES}
    with one_thread():
        for i in range(trials):
            for present, sink in ((True, s_in), (False, s_out)):
                run_seed = seed * 1_000_003 + 2 * i + int(present)
                view = run_federation(fed, datas, {canary: u[0] if present else None}, run_seed, g0, seeded_noise)
                for adv, s in scores(view, u).items():
                    sink[adv].append(float(s[0]))
            if progress is not None:
                progress(i + 1)
    bounds = {a: epsilon_lower_bound(s_in[a], s_out[a], fed.delta, confidence, calibrate) for a in ADVERSARIES}
    return TrialAudit(fed, fed.accountant_epsilon(), bounds, s_in, s_out)


@dataclass(frozen=True)
class OneRunEstimate:
    """Andrew et al.'s one-run estimate per adversary, with the fitted cosines it comes from."""

    federation: AuditFederation
    accountant: float
    dim: int
    estimate: dict[str, float]  # equal spreads: the Gaussian mechanism at mu = mean cosine x sqrt(d)
    estimate_fitted: dict[str, float]  # the canaries' own fitted spread against the null's
    canary_mean: dict[str, float]
    canary_std: dict[str, float]
    null_std: float  # 1 / sqrt(d), the null's exact standard deviation
    unobserved_mean: dict[str, float]  # the null checked on directions that took no part
    unobserved_std: dict[str, float]


def one_run_estimate(fed: AuditFederation, seed: int = 0, unobserved: int = 1000,
                     seeded_noise: bool = False, samples: int = 600) -> OneRunEstimate:
    """One run of ``fed`` with ``fed.canaries`` canary devices, each on its own random direction, in every
    round; each adversary's cosines of the observed and of ``unobserved`` fresh directions with the model's
    change (for the plan reader, after its replay), and the estimate (module docstring)."""
    if fed.canaries < 2:
        raise ValueError(f"the one-run estimate needs several canary devices, got {fed.canaries}")
    datas = digits_clients(fed.trainers, seed, samples)
    g0 = initial_state(seed)
    d = model_dim(g0)
    rng = np.random.default_rng([seed, 7])
    dirs = random_directions(fed.canaries, d, rng)
    null_dirs = random_directions(unobserved, d, rng)
    with one_thread():
        view = run_federation(fed, datas, {fed.trainers + j: dirs[j] for j in range(fed.canaries)}, seed, g0,
                              seeded_noise)
    est, fitted, mean, std, umean, ustd = {}, {}, {}, {}, {}, {}
    for adv, v in adversary_vectors(view).items():
        norm = float(np.linalg.norm(v))
        cos, ncos = dirs @ v / norm, null_dirs @ v / norm  # the directions are unit vectors
        mean[adv], std[adv] = float(np.mean(cos)), float(np.std(cos, ddof=1))
        umean[adv], ustd[adv] = float(np.mean(ncos)), float(np.std(ncos, ddof=1))
        mu = mean[adv] * math.sqrt(d)
        est[adv] = 0.0 if mu <= 0 else gaussian_pair_epsilon(0.0, 1.0, mu, 1.0, fed.delta)
        fitted[adv] = gaussian_pair_epsilon(0.0, 1.0 / math.sqrt(d), mean[adv], std[adv], fed.delta)
    return OneRunEstimate(fed, fed.accountant_epsilon(), d, est, fitted, mean, std, 1.0 / math.sqrt(d), umean, ustd)
