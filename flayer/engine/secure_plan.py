"""What a secure round's plan may say, checked from public facts (docs/explanation/secure-aggregation.md).

One function chooses k and t (:func:`round_degree`): the coordinator calls it to write the plan, every device
calls it again on the plan it reads and refuses a plan below what it would have chosen itself
(:func:`plan_floor_problem`): a cohort under :data:`MIN_COHORT` (or one where the survivor set could hold fewer
than two honest inputs beside the colluders assumed), a k below the one the cohort size, the stated dropout and
colluding fraction give, a t below the majority floor of the plan's k. :func:`plan_context` digests the plan's
other public facts and the digest of the rest of the round plan into the round's transcript
(:attr:`flayer.secagg.SecAggParams.transcript`), which every signature and sealed share of the round covers.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import Any

from flayer.secagg import neighbour_count
from flayer.secagg.consistency import consistency_threshold
from flayer.secagg.graph import round_failure, threshold_floor

from .privacy import RoundPrivacy

__all__ = ["MAX_FAILURE", "MIN_COHORT", "SMALL_COHORT", "accepted_dropout", "check_noise", "cohort_problem", "failure_problem", "plan_context",
           "plan_floor_problem", "round_degree"]

# The least cohort a secure round runs with: the consistency round unmasks only a survivor set S of at least
# T = floor((P + c)/2) + 1 devices, c = max(1, ceil(gamma P)) of them possibly colluding, so S holds at least T - c
# honest inputs; with P = 2 (a victim and one colluder) that is one, and the sum minus the colluder's input is the
# victim's input. T - c >= 2 needs P >= c + 2: three devices at gamma = 0.
MIN_COHORT = 3
_DOMAIN = b"flayer-secagg/v1/plan\x00"
_F64 = struct.Struct("<d")


def cohort_problem(cohort: int, corrupt_fraction: float) -> str | None:
    """Why a cohort of ``cohort`` devices is too small for a secure round at colluding fraction gamma (None: fine):
    fewer than :data:`MIN_COHORT`, or a survivor set that could hold fewer than two honest inputs."""
    colluders = max(1, math.ceil(corrupt_fraction * cohort - 1e-9))
    honest = consistency_threshold(cohort, corrupt_fraction) - colluders if cohort >= 2 else 0
    if cohort < MIN_COHORT or honest < 2:
        return (f"a secure round over {cohort} devices: the unmasked sum could hold {max(honest, 0)} honest input(s) "
                f"beside the {colluders} colluder(s) assumed, and a sum of one honest input is that input (at least "
                f"{MIN_COHORT} devices, two honest inputs in any sum)")
    return None


# The most a round of more than SMALL_COHORT devices may be expected to fail by random dropouts at the design rate, or
# the coordinator refuses to run it: the sparse rule aims at 2^-20 a round, but the complete graph it falls back to at
# high dropout needs a majority of the cohort alive (P = 99 at dropout 0.45: 0.21). A cohort of at most SMALL_COHORT
# devices always has the complete graph; its figure is stated in the round record, never refused (3 devices at 0.1: 0.27)
MAX_FAILURE = 0.01
SMALL_COHORT = 8


def failure_problem(cohort: int, degree: int, threshold: int, dropout: float, corrupt_fraction: float) -> str | None:
    """Why the coordinator refuses to run a round of more than :data:`SMALL_COHORT` devices (None: its failure bound is
    at most :data:`MAX_FAILURE`, or the cohort is small): the
    chance that fewer than max(t, T) of the cohort survive dropouts at the design rate, and with a sparse graph the
    rule's own bounds (:func:`flayer.secagg.graph.round_failure`). Liveness only: a device does not check it."""
    need = max(threshold, consistency_threshold(cohort, corrupt_fraction))
    fail = round_failure(cohort, degree, threshold, need, dropout)
    if fail <= MAX_FAILURE or cohort <= SMALL_COHORT:
        return None
    return (f"refused: at the design dropout {dropout:g}, {cohort} devices (k={degree}, t={threshold}, T={need}) fail "
            f"to unmask with probability {fail:.3g}, above {MAX_FAILURE:g} (the unmasking needs {need} of them alive); "
            f"select more devices or lower the dropout")


def accepted_dropout(cohort: int, dropout: float, corrupt_fraction: float) -> float | None:
    """The highest design dropout, at most ``dropout`` and on its 0.01 grid downward, at which a round of ``cohort``
    devices is not refused by :func:`failure_problem` (with the k and t :func:`round_degree` chooses for it); None:
    none down to 0.01 (too few devices for any)."""
    steps = max(0, math.floor(dropout * 100 + 1e-9))
    for rate in (dropout, *(i / 100 for i in range(steps, 0, -1) if i / 100 < dropout)):
        k, t = round_degree(cohort, rate, corrupt_fraction)
        if failure_problem(cohort, k, t, rate, corrupt_fraction) is None:
            return rate
    return None


def round_degree(cohort: int, dropout: float, corrupt_fraction: float) -> tuple[int, int]:
    """(k, t) for a cohort: the coordinator's choice and every device's floor (:func:`flayer.secagg.neighbour_count`)."""
    return neighbour_count(cohort, dropout, corrupt_fraction=corrupt_fraction)


def plan_floor_problem(cohort: int, degree: int, threshold: int, dropout: float, corrupt_fraction: float) -> str | None:
    """Why a device refuses a plan's cohort, k or t (None: it would have chosen at least as much itself)."""
    why = cohort_problem(cohort, corrupt_fraction)
    if why is not None:
        return why
    k, _ = round_degree(cohort, dropout, corrupt_fraction)
    if degree < k:
        return (f"k={degree} neighbours, below the {k} this device computes for {cohort} devices, dropout {dropout:g} "
                f"and a colluding fraction {corrupt_fraction:g}")
    floor = threshold_floor(cohort, degree, corrupt_fraction)
    if threshold < floor:
        return (f"threshold t={threshold} is below the floor {floor} this device computes for k={degree} neighbours "
                f"and a colluding fraction {corrupt_fraction:g}")
    return None


def plan_context(layout: str, adaptive: bool, noise_std: float, bound: float | None, value_range: float | None,
                 corrupt_fraction: float, run_seed: int | None, value_bits: int, keep: float, dropout: float,
                 plan: bytes = b"") -> bytes:
    """SHA-256 over the plan's public facts beyond :class:`flayer.secagg.SecAggParams` (the layout digest and the keep
    fraction, the bounds, the noise share, the value resolution, the colluding fraction (T), the dropout, the run
    seed) and ``plan``, the digest of every other plan field a device's input depends on
    (:func:`protocol.plan_digest.plan_digest`: the model and its digest, the strategy, its options, the training
    settings, the seed, the privacy terms; empty in process, where every party holds one plan): the same bytes on the
    coordinator and on every device that read the same plan."""
    if not isinstance(plan, bytes) or len(plan) not in (0, 32):
        raise ValueError("the plan digest must be empty or 32 bytes")
    h = hashlib.sha256(_DOMAIN + layout.encode("ascii", "replace") + bytes([bool(adaptive)]))
    for v in (noise_std, bound or 0.0, value_range or 0.0, corrupt_fraction, keep, dropout):
        h.update(_F64.pack(float(v)))
    h.update(struct.pack("<qI", int(run_seed or 0), int(value_bits)) + bytes([len(plan)]) + plan)
    return h.digest()


MAX_WIDEN = 1.1  # the most the ring's rounding may widen a share before the round is refused (secure_ring.ring_noise)


def check_noise(privacy: Mapping[str, Any] | None, threshold: int, noise_std: float, length: int = 0,
                scale: float | None = None) -> None:
    """ValueError unless a distributed-DP round's noise share (``noise_std``, each device's) carries what the plan's
    privacy states: with t or more survivors, at least ``(z C)^2`` on the sum, z the larger of the multiplier the
    ledger books and the update's, widened for the ring's stochastic rounding of ``length`` values at ``scale``
    by ``1 + sqrt(length) / (C scale)`` (:func:`flayer.engine.secure_ring.ring_noise`), which must stay at most
    :data:`MAX_WIDEN`: a ring too coarse for its noise (a share of a small fraction of a ring unit rounds to 0) is
    refused, whatever ``noise_std`` says."""
    rp = RoundPrivacy.from_plan(privacy) if privacy else None
    if rp is None or rp.mode != "local":
        return  # central mode: the coordinator adds the noise (it is trusted with the sum)
    widen = 1.0 if scale is None else 1.0 + math.sqrt(max(1, length)) / (rp.clip * scale)
    if widen > MAX_WIDEN:
        raise ValueError(f"plan: a distributed-DP secure round whose ring (scale {scale:.4g}) rounds {length} values "
                         f"so coarsely that the sensitivity grows by {widen - 1:.0%}, above {MAX_WIDEN - 1:.0%}: "
                         f"refused (the shares would round away)")
    need = max(rp.noise_multiplier, rp.update_multiplier) * rp.clip / math.sqrt(threshold) * widen
    if not rp.ring or not noise_std >= need * (1 - 1e-9):
        raise ValueError(f"plan: a distributed-DP secure round whose noise share {noise_std:.4g} is below the "
                         f"{need:.4g} its privacy states (z {rp.noise_multiplier:g}, C {rp.clip:g}, t {threshold}) "
                         f"or not drawn in the ring: refused (the sum would carry less noise than this device books)")
