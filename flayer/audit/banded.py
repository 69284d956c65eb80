"""The audit of banded correlated noise over a whole run (docs/results/privacy-audit.md, "Banded noise, over a run").

A banded round's own noise is larger than ``z C`` (:mod:`flayer.engine.correlated`): the guarantee is about the
run, ``C x + z`` for the rounds' sums ``x``, with the sensitivity ``||C u||^2 <= k`` that the participation schema
(``max_participations`` k, ``min_separation`` b >= bands) gives. A one-round audit cannot see an error in that
sensitivity, so each trial here runs ``rounds`` rounds of the stream as ``flayer simulate --dp-noise-kind banded``
runs it -- :class:`flayer.simulation._Private` (its :class:`~flayer.engine.correlated.BandedNoise` from the CSPRNG,
the run's coefficients), :class:`flayer.engine.round.OpenAggregate` with ``use_noise``, the device's
:func:`flayer.engine.privacy.privatize` at the shipped per-layer split and the coordinator's
:func:`flayer.engine.gate.admit` at :func:`flayer.engine.privacy.server_bound` -- with the canary device of
:mod:`flayer.audit.mechanism` in the rounds ``canary_rounds`` (its clipped upload, or zeros) and known devices
everywhere else.

The adversary reads the published models: each round's change times m, less the known uploads, is the canary's
contribution plus that round's noise ``w_t``; ``C y = C x + z`` is a Gaussian release, and the Neyman-Pearson
statistic is ``(C u) . (C y)`` with ``u`` the canary's rounds (the coefficients are public: the plan names their
digest). Its claim is what the run's ledger composes (:class:`flayer.engine.adversaries.Accounts` with
``most = k``).

- **honest**: the canary in rounds 0, b, 2b, ... -- the rounds the schema allows whose columns are longest;
- **overlap** twin: the canary in rounds 0, 1, ..., k-1, which the schema's min-separation forbids -- what a
  regression of that refusal (or of the selection that enforces it) would let a device do;
- **half-noise** twin (``noise_scale`` 0.5): the stream draws half the ``z C`` it names.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from flayer.aggregate import DPSumAggregator
from flayer.engine.adversaries import Accounts
from flayer.engine.correlated import coefficients
from flayer.engine.gate import Bounds, admit
from flayer.engine.privacy import RoundPrivacy, server_bound, upload_norm
from flayer.engine.round import OpenAggregate
from flayer.privacy_config import PrivacySettings

from .bounds import epsilon_lower_bound
from .mechanism import (
    DIM,
    LAYERS,
    MechanismAudit,
    Trial,
    _canary,
    _device,
    _flat,
    _known,
    ceiling,
    gaussian_estimate,
    gaussian_lower,
)

__all__ = ["BANDED_BANDS", "BANDED_MOST", "BANDED_ROUNDS", "BandedTrial", "banded_case", "run_banded_audit"]

BANDED_ROUNDS, BANDED_BANDS, BANDED_MOST = 9, 3, 3  # the audited run: 9 rounds, 3 bands, a device in <= 3 rounds


@dataclass(frozen=True)
class BandedTrial:
    """A banded run as the audit runs it: the mechanism trial (settings as named, layout, canary), the settings
    the stream draws from (half the noise in the half-noise twin) and the canary's rounds."""

    trial: Trial
    drawn: PrivacySettings
    rounds: int
    canary_rounds: tuple[int, ...]
    row: str

    def strategy(self) -> np.ndarray:
        """The lower-triangular banded Toeplitz C of the run (public coefficients)."""
        coef = coefficients(self.rounds, self.trial.settings.noise_bands)
        c = np.zeros((self.rounds, self.rounds))
        for t in range(self.rounds):
            for i in range(min(coef.size, t + 1)):
                c[t, t - i] = coef[i]
        return c


def banded_case(z: float, row: str = "honest", m: int = 3, rounds: int = BANDED_ROUNDS, bands: int = BANDED_BANDS,
                most: int = BANDED_MOST, clip: float = 1.0, delta: float = 1e-5,
                clip_split: str = "sqrt") -> BandedTrial:
    """The banded run at multiplier ``z``: ``max_participations`` ``most``, ``min_separation`` = ``bands`` (the
    least the settings accept). ``row``: "honest", "overlap" or "half-noise" (module docstring). ValueError where
    the honest canary's rounds are refused by the schema (the audit checks them with the schema's own rule)."""
    s = PrivacySettings(enabled=True, mode="central", clip=clip, noise_multiplier=z, delta=delta,
                        clip_split=clip_split, noise_kind="banded", noise_bands=bands,  # type: ignore[arg-type]
                        max_participations=most, min_separation=bands).resolve(max(100, 10 * m), m)
    canary = tuple(range(most)) if row == "overlap" else tuple(range(0, bands * most, bands))
    if max(canary) >= rounds:
        raise ValueError(f"{rounds} rounds cannot hold the canary's rounds {canary}")
    refusal = None
    for i, r in enumerate(canary):
        refusal = refusal or s.schema.refuses(list(canary[:i]), r)
    if (refusal is None) == (row == "overlap"):
        raise ValueError(f"the {row} canary's rounds {canary}: schema says {refusal or 'allowed'}")
    drawn = dataclasses.replace(s, noise_multiplier=z * 0.5) if row == "half-noise" else s
    rp = RoundPrivacy.of(s)
    trial = Trial(f"banded-{clip_split}" if clip_split != "sqrt" else "banded", s, rp, RoundPrivacy.of(drawn),
                  False, False, "public")
    return BandedTrial(trial, drawn, rounds, canary, row)


def _run(bt: BandedTrial, canary: bool, known: list[np.ndarray]) -> np.ndarray:
    """One run; per round, what the reader recovers of the canary's direction: m x the model's change, less the
    known uploads."""
    from flayer.simulation import _Private

    t, m = bt.trial, bt.trial.m
    private = _Private(bt.drawn, bt.rounds)
    g = {"w": torch.zeros(DIM)} if t.rp.clip_split == "total" else {k: torch.zeros(2) for k in LAYERS}
    big, u = _canary(t)
    ys = np.zeros(bt.rounds)
    for r in range(bt.rounds):
        rp = private.round(m)
        agg = OpenAggregate(None, g, rp, None)  # type: ignore[arg-type]  # a private round never asks the strategy
        assert isinstance(agg.aggregator, DPSumAggregator)
        agg.aggregator.use_noise(private.banded_noise(g, None))
        bounds = Bounds(server_bound(rp, agg.coordinates), "clip")
        here = [big if canary else np.zeros(DIM)] if r in bt.canary_rounds else []
        others = known[: m - len(here)]
        for values in here + others:
            up = _device(t, values)
            agg.fold(admit(up, upload_norm(up), bounds))
        new = agg.result()
        change = _flat(t, {k: v.numpy() for k, v in new.items()}) - _flat(t, {k: v.numpy() for k, v in g.items()})
        ys[r] = m * float(change @ u) - float(sum(k @ u for k in others))
        g = new
    return ys


def claimed_epsilon(bt: BandedTrial) -> float:
    """What the run's ledger composes against the models' readers: every round's plan as named, m folded,
    under the schema's ``most``."""
    s = bt.trial.settings
    acc = Accounts(s.mode, False, most=s.max_participations)
    for _ in range(bt.rounds):
        acc.compose(bt.trial.rp, bt.trial.m)
    assert s.delta is not None
    return acc.public_epsilon(s.delta)


def run_banded_audit(bt: BandedTrial, trials: int, calibrate: float = 0.3, candidates: int = 4000) -> MechanismAudit:
    """``trials`` runs in each world; the figures of :class:`flayer.audit.mechanism.MechanismAudit` (its
    ``noise_scale`` is the drawn multiplier over the named one)."""
    t = bt.trial
    known = _known(t.m + 1, t.rp.clip)  # m known devices: a round without the canary folds m of them
    c = bt.strategy()
    u = np.zeros(bt.rounds)
    u[list(bt.canary_rounds)] = 1.0
    cu = c @ u
    t0 = time.perf_counter()
    scores = {w: np.array([float(cu @ (c @ _run(bt, w, known))) for _ in range(trials)]) for w in (True, False)}
    assert t.settings.delta is not None
    delta = t.settings.delta
    bound = epsilon_lower_bound(list(scores[True]), list(scores[False]), delta, calibrate=calibrate, candidates=candidates)
    return MechanismAudit(f"{t.name} ({bt.row})", t.adversary, t.rp.noise_multiplier,
                          bt.drawn.noise_multiplier / t.settings.noise_multiplier, claimed_epsilon(bt), bound,
                          gaussian_estimate(scores[True], scores[False], delta),
                          gaussian_lower(scores[True], scores[False], delta), ceiling(bound.certified_in, delta),
                          time.perf_counter() - t0)
