"""Secure rounds in the round engine: the coordinator folds the unmasked SUM of a round's uploads, never one.

What a driver does with :mod:`flayer.secagg` (docs/explanation/secure-aggregation.md):

1. **Common positions.** Every selected device's upload is laid out on the round's common layout
   (:mod:`flayer.engine.secure_layout`: FLAYER's public positions, or a strategy's dense shared layers).
   With adaptive clipping the clip bit ``b_k`` rides as one more coordinate, so only its sum is seen.
2. **Ring.** Each value is clipped to ``[-R, R]`` and quantised into Z_{2^32} with stochastic rounding
   (:func:`flayer.secagg.ring.encode`), the scale chosen so the sum of the round's cohort never wraps.
3. **Protocol.** Keys, encrypted shares, masked inputs, unmasking with the survivors' shares
   (:func:`flayer.secagg.local.run_round` in process; the same state machines over MQTT).
4. **Fold.** The unmasked ring sum is decoded, checked (:func:`check_sum`: no sum of ``count`` honest
   uploads exceeds ``count`` times the bound each is clipped to), and folded as ``count`` contributions
   into the fixed-denominator sum (:class:`flayer.aggregate.DPSumAggregator`): with DP the denominator is
   the planned m and the coordinator adds the central noise to the unmasked sum; without DP it is the
   number of survivors (an unweighted mean: a device's sample count is not in the sum).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flayer.privacy_config import PrivacySettings
from flayer.secagg import RingSpec, SecAggParams, decode_sum, encode, neighbour_count
from flayer.secagg.noise import discrete_gaussian
from flayer.strategies.base import derive_seed
from flayer.update import Update

from .privacy import UNCLIPPED_KEY, RoundPrivacy
from .secure_layout import Layout, flatten, layout_of, unflatten

__all__ = ["DROP_STAGES", "PlannedSecure", "SecureSum", "check_sum", "device_vector", "drops_for", "plan_secure",
           "ring_noise", "round_params", "secure_bound", "secure_from_plan", "secure_sum", "sum_update"]

DROP_STAGES = ("after_keys", "after_shares", "after_masked")


@dataclass(frozen=True)
class SecureSum:
    """A secure round's result as the coordinator sees it: the decoded sum (None: abandoned)."""

    update: Update | None  # the sum of the survivors' uploads at the common layout
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    reason: str | None = None  # why the round was abandoned
    bits: float = 0.0  # adaptive clipping: the sum of the survivors' clip bits
    bytes_per_device: Mapping[str, int] = field(default_factory=dict)
    messages_per_device: Mapping[str, int] = field(default_factory=dict)


def ring_noise(rp: RoundPrivacy | None, threshold: int, n: int, clip_range: float, cohort: int
               ) -> tuple[float, RingSpec]:
    """Distributed DP in the ring (local-mode noise in a secure round, :mod:`flayer.secagg.noise`): (each
    device's discrete Gaussian share, its std in value units; the ring, sized for the values and the noise).

    The round is unmasked only with >= t survivors, so shares of variance ``(z_Delta C)^2 / t`` give the sum
    at least the noise ``(z_Delta C)^2`` the accountant composes, whoever drops out. In the ring a clipped
    upload's sensitivity grows by the stochastic rounding, at most ``sqrt(n)`` ring units over C s, so the
    share is widened by ``1 + sqrt(n) / (C s)``: the noise-to-sensitivity ratio stays z. Each value's range
    gets 9 standard deviations of headroom for the share, so the cohort's sum cannot wrap."""
    if rp is None or rp.mode != "local":
        return 0.0, RingSpec.for_summands(clip_range, cohort)
    sigma = rp.sum_std / math.sqrt(threshold)
    ring = RingSpec.for_summands(clip_range + 9.0 * sigma, cohort)
    assert ring.scale is not None
    widen = 1.0 + math.sqrt(n) / (rp.clip * ring.scale)
    if widen > 1.1:
        raise ValueError(f"the ring is too coarse for distributed noise: rounding adds {widen - 1:.0%} to the "
                         f"sensitivity; lower secure_clip_range or the cohort")
    return sigma * widen, ring


def round_params(s: PrivacySettings, session: str, round_: int, participants: tuple[str, ...], layout: Layout,
                 seed: int, rp: RoundPrivacy | None = None) -> tuple[SecAggParams, float]:
    """(the round's public protocol parameters, each device's noise share in the ring or 0): the ring of
    range R for the cohort (with room for the noise, :func:`ring_noise`), k and t for the dropout rate
    ``secure_dropout``, the neighbour graph drawn from the run seed and the round."""
    adaptive = s.enabled and s.clipping == "adaptive"
    length = layout.n + int(adaptive)
    k, t = neighbour_count(len(participants), s.secure_dropout)
    noise, ring = ring_noise(rp, t, length, max(s.clip_range, 1.0) if adaptive else s.clip_range,
                             len(participants))
    graph_seed = hashlib.sha256(f"secagg-graph:{seed}:{round_}".encode()).digest()
    return SecAggParams(session, round_, participants, t, k, graph_seed, length, ring), noise


def device_vector(update: Update, layout: Layout, params: SecAggParams, rng: np.random.Generator,
                  adaptive: bool = False, noise_std: float = 0.0) -> np.ndarray:
    """A device's input to the masked sum: its values on the common layout (and its clip bit), in the ring,
    plus its discrete Gaussian share of the round's noise (``noise_std`` in value units; 0: none)."""
    values = flatten(update, layout)
    if adaptive:
        values = np.append(values, float(update.info.get(UNCLIPPED_KEY, 0.0)))
    q = encode(values, params.ring, rng)
    if noise_std <= 0:
        return q
    assert params.ring.scale is not None
    share = discrete_gaussian(noise_std * params.ring.scale, q.size, rng)
    return ((q.astype(np.int64) + share) & np.int64(params.ring.modulus - 1)).astype(np.uint32)


def secure_bound(rp: RoundPrivacy | None, noise_std: float, n: int) -> float | None:
    """The L2 bound each honest secure upload keeps, for :func:`check_sum`: C with central DP; C plus room for
    its noise share with distributed DP (``C + 2 sigma sqrt(n)``); None without DP (the ring's range only)."""
    if rp is None:
        return None
    return rp.clip + 2.0 * noise_std * math.sqrt(max(1, n))


def check_sum(total: np.ndarray, count: int, bound: float | None) -> str | None:
    """Why an unmasked sum cannot be ``count`` clipped uploads (None: it can): each honest upload has L2
    norm at most ``bound`` (the DP clip, or None: only the ring's per-coordinate range applies), so their
    sum has norm at most ``count * bound`` -- a device that masked values past its clip shows here."""
    if bound is None or count == 0:
        return None
    norm = float(np.linalg.norm(total))
    limit = count * bound * (1 + 1e-6) + math.sqrt(total.size) * count * 1e-6
    if norm > limit:
        return (f"the unmasked sum's norm {norm:.4g} exceeds {count} x the clip bound {bound:g}: a device "
                f"masked values outside its clip")
    return None


def sum_update(ring_sum: np.ndarray, params: SecAggParams, layout: Layout, count: int,
               bound: float | None, adaptive: bool = False) -> tuple[Update | None, float, str | None]:
    """(the decoded sum as an update at the common layout, the clip-bit sum, why refused or None)."""
    try:
        total = decode_sum(ring_sum, params.ring, count)
    except ValueError as exc:
        return None, 0.0, f"the unmasked sum is out of the ring's range ({exc})"
    bits = 0.0
    if adaptive:
        total, bits = total[:-1], float(total[-1])
    why = check_sum(total, count, bound)
    if why is not None:
        return None, 0.0, why
    return unflatten(total, layout, count), bits, None


def drops_for(selected: tuple[str, ...], rate: float, seed: int, round_: int) -> dict[str, str]:
    """``flayer simulate``'s planned dropouts: each selected device drops with probability ``rate`` at a
    protocol step drawn uniformly (after its keys, after its shares, or after its masked input)."""
    if rate <= 0:
        return {}
    rng = np.random.default_rng(derive_seed(seed, round_, "secagg-drops"))
    out: dict[str, str] = {}
    for dev in selected:
        gone, stage = rng.random() < rate, DROP_STAGES[int(rng.integers(len(DROP_STAGES)))]
        if gone:
            out[dev] = stage
    return out


def common_layout(uploads: Mapping[str, Update]) -> Layout:
    """The layout the round's uploads share; ValueError naming a device whose layout differs."""
    layouts = {dev: layout_of(up) for dev, up in uploads.items()}
    first = next(iter(layouts.values()))
    for dev, lay in layouts.items():
        if lay.digest != first.digest:
            raise ValueError(f"device {dev}'s upload positions differ from the round's common layout: secure "
                             f"rounds need data-independent positions (positions = \"public\")")
    return first


def secure_sum(s: PrivacySettings, session: str, round_: int, seed: int, uploads: Mapping[str, Update],
               bound: float | None, drops: Mapping[str, str] | None = None,
               rp: RoundPrivacy | None = None, seeded: bool = False) -> SecureSum:
    """Run a secure round in process over ``uploads`` (device id -> its clipped upload) with ``drops`` (device
    -> the step it drops after), by the protocol code the coordinator runs: the sum of the survivors, decoded
    and checked (:func:`sum_update`, against ``bound``), or the reason the round was abandoned. ``rp``: the
    private round; in local mode the devices add their noise shares in the ring and the bound makes room for
    them. The devices' entropy (keys, masks, rounding, noise) comes from the operating system's CSPRNG, as on a
    real device; ``seeded`` (``flayer simulate --dp-seeded-noise``: reproducible, not private) draws it from
    the run seed and the round instead."""
    from flayer.secagg import run_round

    participants = tuple(sorted(uploads))
    if len(participants) < 2:
        return SecureSum(None, participants, (), f"{len(participants)} device(s) uploaded: a secure sum needs >= 2")
    layout = common_layout(uploads)
    params, noise = round_params(s, session, round_, participants, layout, seed, rp)
    if noise > 0:
        bound = secure_bound(rp, noise, params.length)
    adaptive = s.enabled and s.clipping == "adaptive"
    vectors = {dev: device_vector(up, layout, params, np.random.default_rng(derive_seed(seed, round_, dev, "secagg")
                                                                            if seeded else secrets.randbits(256)),
                                  adaptive, noise) for dev, up in uploads.items()}
    run_seed = hashlib.sha256(f"secagg-run:{seed}:{round_}".encode()).digest() if seeded else secrets.token_bytes(32)
    out = run_round(params, vectors, drop_after=dict(drops or {}), seed=run_seed)  # type: ignore[arg-type]
    survivors, dropped = tuple(sorted(out.survivors)), tuple(sorted(set(participants) - set(out.survivors)))
    if out.ring_sum is None or out.abandoned_reason is not None:
        return SecureSum(None, survivors, dropped, out.abandoned_reason, 0.0, out.bytes_per_device,
                         out.messages_per_device)
    total, bits, why = sum_update(out.ring_sum, params, layout, len(survivors), bound, adaptive)
    return SecureSum(total, survivors, dropped, why, bits, out.bytes_per_device, out.messages_per_device)


def plan_secure(params: SecAggParams, layout: Layout, adaptive: bool, stage_s: float,
                noise_std: float = 0.0) -> dict[str, Any]:
    """The plan's ``secure`` mapping: what every selected device needs to run the round's protocol
    (participants are the plan's ``selected``)."""
    assert params.ring.scale is not None
    return {"session": params.session, "threshold": params.threshold, "degree": params.degree,
            "graph_seed": params.graph_seed.hex(), "length": params.length, "clip_range": params.ring.clip_range,
            "scale": params.ring.scale, "max_summands": params.ring.max_summands, "layout": layout.digest,
            "adaptive": adaptive, "stage_s": stage_s, "noise_std": noise_std}


@dataclass(frozen=True)
class PlannedSecure:
    params: SecAggParams
    layout: str  # the digest of the round's common layout
    adaptive: bool  # the vector's last coordinate is the clip bit
    stage_s: float
    noise_std: float = 0.0  # distributed DP: each device's discrete Gaussian share, in value units (ring_noise)


def secure_from_plan(raw: Mapping[str, Any], round_: int, selected: tuple[str, ...]) -> PlannedSecure | None:
    """A plan's secure round (None: not one); ValueError naming what is malformed."""
    if not raw:
        return None
    try:
        ring = RingSpec(float(raw["clip_range"]), 32, float(raw["scale"]), int(raw["max_summands"]))
        seed = bytes.fromhex(str(raw["graph_seed"]))
        params = SecAggParams(str(raw["session"]), round_, tuple(selected), int(raw["threshold"]), int(raw["degree"]),
                              seed, int(raw["length"]), ring)
        stage_s = float(raw.get("stage_s", 10.0))
        noise_std = float(raw.get("noise_std", 0.0))
        layout = str(raw["layout"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"plan: malformed secure-round parameters ({exc})") from None
    if len(layout) != 64 or not (0 < stage_s <= 86_400) or not (0 <= noise_std <= 1e6 and math.isfinite(noise_std)):
        raise ValueError("plan: malformed secure-round parameters (layout digest, stage_s or noise_std)")
    return PlannedSecure(params, layout, bool(raw.get("adaptive", False)), stage_s, noise_std)
