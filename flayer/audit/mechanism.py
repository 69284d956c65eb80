"""An audit of every private mechanism with the power to catch a mis-accounted one (docs/results/privacy-audit.md).

Each trial runs one private round of a small federation through the code the drivers run -- the device's
:func:`flayer.engine.privacy.privatize` (clip, clip bit, local noise share), the coordinator's check and re-clip
(:func:`flayer.engine.gate.admit` at :func:`flayer.engine.privacy.server_bound`), the fixed-denominator noised sum
of :class:`flayer.engine.round.OpenAggregate` with its noise from the operating system's CSPRNG, the adaptive clip
update :func:`flayer.engine.privacy.next_clip`, and for secure rounds the whole in-process SecAgg+ protocol
(:func:`flayer.engine.secure.secure_sum`) -- at the shipped per-layer clip split (``clip_split = "sqrt"``, a
two-layer model; ``fixed-total`` audits one bound) -- with a **canary device** whose upload fills every layer's
bound (clipped to norm exactly C, clip bit 0) in one world and zeros (clip bit 1) in the other: the zero-out neighbours the
privacy page states. The other ``m - 1`` devices upload fixed vectors the adversary knows (the worst case DP
allows: it knows everything but the canary's data).

The adversary's score is the likelihood-ratio statistic of what it sees -- optimal (Neyman-Pearson) for the
Gaussian releases it faces, so the audit gives away no power to a weak test:

- ``public`` (readers of the published models, devices, observers): the next model's coordinate 0, times m, less
  the known uploads, over the update noise's variance; with adaptive clipping, minus the clip-bit count it reads
  back from the next C (``next_clip`` inverted where b_bar is inside (0, 1)), over the bit noise's variance.
- ``coordinator`` (local mode without secure aggregation): the canary's upload as it arrives, coordinate 0.

:func:`run_audit` turns the scores into a Clopper-Pearson lower bound (:func:`flayer.audit.bounds.epsilon_lower_bound`)
beside the accountant's epsilon -- what :class:`flayer.engine.adversaries.Accounts` composes for that round, the
ledgers' own code -- a Gaussian-DP estimate from the scores' means and spreads, and the audit's **ceiling**: the
most its certified trials could show even with no error at all. ``noise_scale`` < 1 runs a mis-accounted twin:
the mechanism draws that fraction of the noise its plan names while the accountant is asked about the plan as
named -- the audit must catch it. Banded correlated noise, whose guarantee is over a run, is audited run by run
in :mod:`flayer.audit.banded`.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flayer.engine.adversaries import Accounts
from flayer.engine.gate import Bounds, admit
from flayer.engine.privacy import RoundPrivacy, clip_upload, next_clip, privatize, server_bound, upload_norm
from flayer.engine.round import OpenAggregate
from flayer.engine.secure_plan import round_degree
from flayer.privacy_config import PrivacySettings
from flayer.secagg.prg import KeystreamRandom
from flayer.update import TensorDelta, Update

from .bounds import AuditBound, epsilon_lower_bound

__all__ = [
    "MECHANISMS",
    "SECURE_DISTRIBUTED_M",
    "SPLITS",
    "MechanismAudit",
    "Trial",
    "ceiling",
    "claimed_epsilon",
    "gaussian_estimate",
    "gaussian_lower",
    "half_sensitivity_plan",
    "mechanism_case",
    "run_audit",
]

# every private mechanism the docs offer: name -> (mode, clipping, secure, asynchronous, adversary)
MECHANISMS: dict[str, tuple[str, str, bool, bool, str]] = {
    "fixed": ("central", "fixed", False, False, "public"),
    "adaptive": ("central", "adaptive", False, False, "public"),
    "local": ("local", "fixed", False, False, "public"),
    "local-coordinator": ("local", "fixed", False, False, "coordinator"),
    "async": ("central", "fixed", False, True, "public"),
    "async-adaptive": ("central", "adaptive", False, True, "public"),
    "async-local": ("local", "fixed", False, True, "public"),
    "secure-central": ("central", "fixed", True, False, "public"),
    "secure-adaptive": ("central", "adaptive", True, False, "public"),
    "secure-distributed": ("local", "fixed", True, False, "public"),
    "fixed-total": ("central", "fixed", False, False, "public"),
}
# each mechanism's clip_split: the shipped default "sqrt" (a bound a layer) unless named here. The audited model has
# two layers and the canary fills both bounds, so its clipped upload has norm C along a direction spread over the
# layers; "total" (one bound on the whole upload, one tensor) is what an operator gets by asking for it
SPLITS: dict[str, str] = {"fixed-total": "total"}
LAYERS = {"a.weight": slice(0, 2), "b.weight": slice(2, 4)}  # the layered model's two layers over the DIM coordinates
SECURE_DISTRIBUTED_M = 6  # the cohort whose consistency threshold lets the audit drop to t survivors (m = 3 cannot)
DIM = 4  # coordinates of the audited model: the canary's are on 0, the known uploads on the others too
SCALE = 1e3  # the canary's upload norm before the device clips it (far above C)
SESSION = "audit"


@dataclass(frozen=True)
class Trial:
    """One mechanism as a trial runs it: the plan's privacy, the settings behind it, who looks."""

    name: str
    settings: PrivacySettings  # resolved
    rp: RoundPrivacy  # what the plan names (the accountant is asked about this)
    drawn: RoundPrivacy  # what the mechanism draws: rp, or a twin with less noise (noise_scale < 1)
    secure: bool
    asynchronous: bool
    adversary: str
    drops: int = 0  # distributed noise: known devices that drop after their shares, so t survivors carry the sum

    @property
    def m(self) -> int:
        return self.rp.contributions


def mechanism_case(name: str, z: float, m: int = 3, clip: float = 1.0, delta: float = 1e-5,
                   count_stddev: float | None = None, noise_scale: float = 1.0,
                   rp_of: Callable[[PrivacySettings], RoundPrivacy] | None = None) -> Trial:
    """The trial of mechanism ``name`` (:data:`MECHANISMS`) at multiplier ``z`` with ``m`` contributions of a round.
    ``rp_of``: how the plan's privacy is made from the settings (default :meth:`RoundPrivacy.of`, the drivers'
    own; an audit of another rule passes its own); ``noise_scale``: the mis-accounted twin (module docstring)."""
    mode, clipping, secure, asynchronous, adversary = MECHANISMS[name]
    s = PrivacySettings(enabled=True, mode=mode, clip=clip, noise_multiplier=z, delta=delta, clipping=clipping,  # type: ignore[arg-type]
                        count_stddev=count_stddev, clip_split=SPLITS.get(name, "sqrt"),  # type: ignore[arg-type]
                        secure_aggregation=secure,
                        secure_corrupt_fraction=0.0, secure_dropout=0.0).resolve(max(100, 10 * m), m)
    rp = (rp_of or RoundPrivacy.of)(s)
    if secure and mode == "local":
        rp = dataclasses.replace(rp, ring=True)
    drawn = rp if noise_scale == 1.0 else dataclasses.replace(
        rp, noise_multiplier=rp.noise_multiplier * noise_scale, update_multiplier=rp.update_multiplier * noise_scale,
        bit_std=rp.bit_std * noise_scale)
    trial = Trial(name, s, rp, drawn, secure, asynchronous, adversary)
    if secure and mode == "local":  # distributed noise is sized for t survivors: the worst case drops the rest --
        for drops in range(m - round_degree(m, 0.0, 0.0)[1], 0, -1):  # as many known devices as still unmask
            candidate = dataclasses.replace(trial, drops=drops)
            try:
                _release(candidate, False, _known(m, clip))
            except RuntimeError:
                continue
            return candidate
    return trial


def half_sensitivity_plan(s: PrivacySettings, bit_std: float) -> RoundPrivacy:
    """A deliberately mis-accounted adaptive plan, for showing that the audit catches one: the update noise an
    earlier release derived with the clip bits' sensitivity taken as 1/2, ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``,
    at clip-bit noise ``bit_std``, labelled z (a zero upload reports bit 1: the sensitivity is 1)."""
    z = s.noise_multiplier
    assert s.expected_contributions is not None
    return RoundPrivacy("central", s.clip, z, (z ** -2 - (2 * bit_std) ** -2) ** -0.5, s.expected_contributions, True,
                        bit_std)


def _vec(values: np.ndarray, layered: bool = False) -> Update:
    if layered:
        return Update({k: TensorDelta((2,), values[sl].astype(np.float32)) for k, sl in LAYERS.items()}, 1, {})
    return Update({"w": TensorDelta((DIM,), values.astype(np.float32))}, 1, {})


def _flat(t: Trial, state: dict[str, Any]) -> np.ndarray:
    """A model or upload of the trial's layout as one DIM-vector."""
    if t.rp.clip_split == "total":
        return np.asarray(state["w"], dtype=np.float64).reshape(-1)
    return np.concatenate([np.asarray(state[k], dtype=np.float64).reshape(-1) for k in LAYERS])


def _canary(t: Trial) -> tuple[np.ndarray, np.ndarray]:
    """(what the canary uploads before its clip, the unit direction of its clipped upload): ``SCALE e_0`` and
    ``e_0``; per-layer bounds, ``SCALE`` on the first coordinate of each layer, clipped to ``C_i`` on each, so its
    clipped norm is C, spread over the layers."""
    values, u = np.zeros(DIM), np.zeros(DIM)
    if t.rp.clip_split == "total":
        values[0], u[0] = SCALE, 1.0
        return values, u
    for sl in LAYERS.values():
        values[sl.start] = SCALE
    clipped, _ = clip_upload(_vec(values, True), t.rp.clip, t.rp.clip_split)  # the device's clip (no noise share)
    out = _flat(t, {k: d.values for k, d in clipped.deltas.items()})
    return values, out / np.linalg.norm(out)


def _known(m: int, clip: float) -> list[np.ndarray]:
    """The other devices' uploads: fixed, inside C (clip bit 1), known to the adversary."""
    rng = np.random.default_rng(12345)  # public by design: the adversary knows these uploads
    out = []
    for _ in range(m - 1):
        v = rng.normal(size=DIM)
        out.append(0.3 * clip * v / np.linalg.norm(v))
    return out


def _device(t: Trial, values: np.ndarray) -> Update:
    """What one device sends: privatize's clip, clip bit and (local mode) noise share from the CSPRNG."""
    rng = KeystreamRandom() if t.drawn.share_std > 0 else None  # what devices draw their shares from
    return privatize(_vec(values, t.rp.clip_split != "total"), t.drawn, rng)


def _release(t: Trial, canary: bool, known: list[np.ndarray]) -> tuple[float, float | None, float]:
    """One round; (what the adversary reads on coordinate 0, the clip-bit count it reads back or None, the known
    uploads' share of coordinate 0 in the sum: every known upload but those that dropped)."""
    rp = t.drawn
    g = {"w": torch.zeros(DIM)} if rp.clip_split == "total" else {k: torch.zeros(2) for k in LAYERS}
    big, u = _canary(t)
    values = big if canary else np.zeros(DIM)
    uploads = [_device(t, values)] + [_device(t, k) for k in known]
    known0 = float(sum(k @ u for k in known))  # the known uploads are inside every bound: folded as they are
    if t.adversary == "coordinator":  # it reads the canary's upload as it arrives
        return float(_flat(t, {k: d.values for k, d in uploads[0].deltas.items()}) @ u), None, known0
    agg = OpenAggregate(None, g, rp, None)  # type: ignore[arg-type]  # a private round never asks the strategy
    if t.secure:
        from flayer.engine.secure import secure_sum

        names = [f"d{i:03d}" for i in range(len(uploads))]
        dropped = names[len(names) - t.drops:] if t.drops else []  # known devices, never the canary (d000)
        out = secure_sum(t.settings, SESSION, 1, secrets.randbits(31), dict(zip(names, uploads)), None,
                         {d: "after_shares" for d in dropped}, rp=rp)  # type: ignore[arg-type]
        if out.update is None:
            raise RuntimeError(f"audit: the secure round was abandoned: {out.reason}")
        agg.fold_sum(out.update, len(out.survivors), out.bits, out.noised)
        known0 -= float(sum(known[names.index(d) - 1] @ u for d in dropped))
    else:
        staleness = 0  # the strongest canary: trained on the current version (a stale one is scaled down)
        bounds = Bounds(server_bound(rp, agg.coordinates), "clip", 2**32, 4 if t.asynchronous else 0)
        for up in uploads:
            verdict = admit(up, upload_norm(up), bounds, staleness)
            agg.fold(verdict)
    x = float(_flat(t, {k: v.numpy() for k, v in agg.result().items()}) @ u)
    bits = None
    if rp.adaptive:  # the next C is public; invert next_clip where b_bar was not clamped
        s = t.settings
        c1 = next_clip(rp.clip, agg.noised_bits(), rp.contributions, s.target_quantile, s.clip_lr)
        bits = (s.target_quantile - math.log(c1 / rp.clip) / s.clip_lr) * rp.contributions
    return x, bits, known0


def _score(t: Trial, x: float, bits: float | None, known0: float) -> float:
    """The likelihood-ratio statistic (module docstring), with the noise the mechanism draws. Without a clip-bit
    release it is the canary's coordinate alone (any positive scale of it is the same test)."""
    rp = t.drawn
    if t.adversary == "coordinator":
        return x
    signal = x * rp.contributions - known0  # the canary's C (or 0) plus noise
    if bits is None:
        return signal
    # adaptive (central mode): the update release and the bit release, each over its noise's variance
    return signal * rp.clip / max(rp.sum_std ** 2, 1e-300) - bits / max(rp.bit_std ** 2, 1e-300)


def claimed_epsilon(t: Trial) -> float:
    """The accountant's epsilon for the round against ``t.adversary``: :class:`Accounts` composing the plan's
    privacy (``t.rp``, as named) with every contribution folded."""
    acc = Accounts(t.rp.mode, t.secure)
    acc.compose(t.rp, t.rp.contributions)
    assert t.settings.delta is not None
    return acc.epsilons(t.settings.delta)[t.adversary]


def gaussian_estimate(scores_in: np.ndarray, scores_out: np.ndarray, delta: float) -> float:
    """The Gaussian-DP estimate: the epsilon at delta of a Gaussian mechanism whose shift over its spread is the
    scores' (means' difference over the pooled standard deviation). An estimate, no confidence: for the Gaussian
    releases audited here it approaches the true epsilon as trials grow."""
    from flayer.engine.accountant import gaussian_epsilon

    pooled = math.sqrt((float(scores_in.var()) + float(scores_out.var())) / 2)
    mu = abs(float(scores_in.mean()) - float(scores_out.mean())) / pooled if pooled > 0 else math.inf
    return 0.0 if mu == 0 else math.inf if not math.isfinite(mu) else gaussian_epsilon(1.0 / mu, delta)


def gaussian_lower(scores_in: np.ndarray, scores_out: np.ndarray, delta: float, sigmas: float = 4.0) -> float:
    """A parametric lower bound: the epsilon of the Gaussian mechanism whose shift over spread is the scores'
    estimate less ``sigmas`` standard errors (Var(mu_hat) ~ 1/n_in + 1/n_out + mu^2 / (2 (n_in + n_out))). It is a
    bound only where the score is a linear function of Gaussian releases (the fixed, local and asynchronous
    mechanisms); where it is not -- the adaptive score's clip-bit count read back from a clamped C, the secure
    ring's discrete values -- it is an estimate that may overstate (a clamped score can shrink the spread more
    than the shift), so it can raise a false alarm there, never hide a break: the Clopper-Pearson bound is the
    one that holds for every mechanism. It needs far fewer trials (what the suite's short audit uses); at 4 sigma
    an honest mechanism exceeds its accountant's epsilon by chance about 3 times in 100,000."""
    from flayer.engine.accountant import gaussian_epsilon

    n1, n0 = len(scores_in), len(scores_out)
    pooled = math.sqrt((float(scores_in.var()) + float(scores_out.var())) / 2)
    if pooled <= 0:
        return math.inf
    mu = abs(float(scores_in.mean()) - float(scores_out.mean())) / pooled
    low = mu - sigmas * math.sqrt(1 / n1 + 1 / n0 + mu * mu / (2 * (n1 + n0)))
    return 0.0 if low <= 0 else gaussian_epsilon(1.0 / low, delta)


def ceiling(certified: int, delta: float, confidence: float = 0.95) -> float:
    """The largest bound ``certified`` trials a world can give: a test with no error at all."""
    from .bounds import clopper_pearson_upper, epsilon_from_rates

    h = clopper_pearson_upper(0, certified, (1 - confidence) / 2)
    return epsilon_from_rates(h, h, delta)


@dataclass(frozen=True)
class MechanismAudit:
    name: str
    adversary: str
    z: float
    noise_scale: float
    claimed: float  # the accountant's epsilon
    bound: AuditBound  # the 95% Clopper-Pearson lower bound
    gdp_estimate: float  # Gaussian-DP estimate from the scores' means and spreads (no confidence)
    gdp_lower: float  # its 4-sigma parametric lower bound (:func:`gaussian_lower`)
    ceiling: float  # the most the certified trials could show
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"mechanism": self.name, "adversary": self.adversary, "z": self.z, "noise_scale": self.noise_scale,
                "claimed": self.claimed, "bound": self.bound.epsilon, "gdp_estimate": self.gdp_estimate,
                "gdp_lower": self.gdp_lower,
                "ceiling": self.ceiling, "trials": self.bound.trials_in, "fpr": self.bound.fpr,
                "fnr": self.bound.fnr, "seconds": self.seconds}


def run_audit(t: Trial, trials: int, calibrate: float = 0.3, candidates: int = 4000,
              claimed: float | None = None) -> MechanismAudit:
    """``trials`` rounds in each world through the real code path; the figures of :class:`MechanismAudit`.
    ``claimed``: the epsilon to audit against, when not the accountant's (:func:`claimed_epsilon`) -- e.g. what
    another ledger composed for the same plan."""
    known = _known(t.m, t.rp.clip)
    t0 = time.perf_counter()
    scores = {w: np.array([_score(t, *_release(t, w, known)) for _ in range(trials)]) for w in (True, False)}
    assert t.settings.delta is not None
    delta = t.settings.delta
    bound = epsilon_lower_bound(scores[True], scores[False], delta, calibrate=calibrate, candidates=candidates)
    gdp = gaussian_estimate(scores[True], scores[False], delta)
    return MechanismAudit(t.name, t.adversary, t.rp.noise_multiplier, 1.0 if t.drawn is t.rp else
                          t.drawn.update_multiplier / t.rp.update_multiplier,
                          claimed_epsilon(t) if claimed is None else claimed, bound, gdp,
                          gaussian_lower(scores[True], scores[False], delta),
                          ceiling(bound.certified_in, delta), time.perf_counter() - t0)
