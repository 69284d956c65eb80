"""Secure rounds in the round engine: the coordinator folds the unmasked SUM of a round's uploads, never one.

What a driver does with :mod:`flayer.secagg` (docs/explanation/secure-aggregation.md):

1. **Common positions.** Every selected device's upload is laid out on the round's common layout
   (:mod:`flayer.engine.secure_layout`: FLAYER's public positions, or a strategy's dense shared layers).
   With adaptive clipping the clip bit ``b_k`` rides as one more coordinate, so only its sum is seen.
2. **Ring.** Each value is clipped to ``[-R, R]`` and quantised into Z_{2^32} with stochastic rounding
   (:func:`flayer.secagg.ring.encode`), the scale chosen so the sum of the round's cohort never wraps.
3. **Protocol.** Keys, encrypted shares, masked inputs, consents, unmasking with the survivors' shares
   (:func:`flayer.secagg.local.run_round` in process; the same state machines over MQTT).
4. **Fold.** The unmasked ring sum is decoded, checked (:func:`check_sum`: no sum of ``count`` honest
   uploads exceeds ``count`` times the bound each is clipped to), and folded as ``count`` contributions
   into the fixed-denominator sum (:class:`flayer.aggregate.DPSumAggregator`): with DP the denominator is
   the planned m and the coordinator adds the central noise to the unmasked sum; without DP it is the
   number of survivors (an unweighted mean: a device's sample count is not in the sum).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flayer.privacy_config import PrivacySettings
from flayer.secagg import SecAggParams, decode_sum, encode
from flayer.secagg.noise import discrete_gaussian
from flayer.secagg.prg import KeystreamRandom
from flayer.strategies.base import derive_seed
from flayer.update import Update

from .privacy import UNCLIPPED_KEY, RoundPrivacy
from .secure_check import allowances, central_noise, check_sum
from .secure_fit import check_keep, keep_layout, restrict
from .secure_layout import Layout, flatten, layout_of, unflatten
from .secure_plan import check_noise, cohort_problem, plan_context, plan_floor_problem, round_degree
from .secure_ring import NOISE_HEADROOM, ring_noise, ring_range, round_ring

__all__ = [
    "ABANDON_KINDS",
    "DROP_STAGES",
    "NOISE_HEADROOM",
    "PlannedSecure",
    "SecureSum",
    "abandon_kind",
    "allowances",
    "central_noise",
    "check_sum",
    "contribution_bounds",
    "corrupt_fraction",
    "csprng",
    "device_vector",
    "drops_for",
    "graph_seed_of",
    "plan_round",
    "plan_secure",
    "ring_noise",
    "ring_range",
    "round_params",
    "round_ring",
    "secure_from_plan",
    "secure_sum",
    "sum_update",
]

DROP_STAGES = ("after_keys", "after_shares", "after_masked", "after_consent")


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
    noised: bool = False  # central DP: the sum and bits carry the central noise already (drawn before the checks)


def corrupt_fraction(s: PrivacySettings) -> float:
    """The stated fraction of devices that may collude with the coordinator (``secure_corrupt_fraction``)."""
    return float(s.secure_corrupt_fraction)


def contribution_bounds(s: PrivacySettings, rp: RoundPrivacy | None, norm_bound: float | None) -> tuple[float, float]:
    """(B, R): the L2 bound every device clips its secure upload to -- the round's C with DP, else the
    federation's norm bound (explicit or automatic), else ``secure_clip_range`` (8 by default) -- and the
    per-coordinate range, ``min(R, B)`` with R the configured ``secure_clip_range`` (C with DP, else 8)."""
    bound = rp.clip if rp is not None else norm_bound if norm_bound is not None else s.clip_range
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"a secure round's contribution bound must be a finite number > 0, got {bound!r}")
    return float(bound), float(min(s.clip_range, bound))


def graph_seed_of(seed: int, round_: int) -> bytes:
    """The round's neighbour-graph seed: public, fixed by the run seed and the round (devices recompute it)."""
    return hashlib.sha256(f"secagg-graph:{seed}:{round_}".encode()).digest()


def round_params(s: PrivacySettings, session: str, round_: int, participants: tuple[str, ...], layout: Layout,
                 seed: int, rp: RoundPrivacy | None = None, value_range: float | None = None
                 ) -> tuple[SecAggParams, float]:
    """(the round's public protocol parameters, each device's noise share in the ring or 0): the ring of
    per-coordinate range ``value_range`` (default ``secure_clip_range``) for the cohort (with room for the
    noise, :func:`ring_noise`), k and t for the dropout rate ``secure_dropout`` and the stated colluding
    fraction ``secure_corrupt_fraction``, the neighbour graph drawn from the run seed and the round."""
    adaptive = s.enabled and s.clipping == "adaptive"
    length = layout.n + int(adaptive)
    why = cohort_problem(len(participants), corrupt_fraction(s))
    if why is not None:
        raise ValueError(why)
    k, t = round_degree(len(participants), s.secure_dropout, corrupt_fraction(s))  # the devices' floor, the same call
    noise, ring, _ = ring_noise(rp, t, length, ring_range(s.clip_range if value_range is None else value_range,
                                                          adaptive), len(participants), s.secure_value_bits)
    graph_seed = graph_seed_of(seed, round_)
    return SecAggParams(session, round_, participants, t, k, graph_seed, length, ring), noise


def device_vector(update: Update, layout: Layout, params: SecAggParams, rng: np.random.Generator | KeystreamRandom,
                  adaptive: bool = False, noise_std: float = 0.0, bound: float | None = None,
                  value_range: float | None = None) -> np.ndarray:
    """A device's input to the masked sum: its values on the common layout, scaled to L2 norm at most
    ``bound`` and clipped to ``[-value_range, value_range]`` (and its clip bit), in the ring, plus its
    discrete Gaussian share of the round's noise (``noise_std`` in value units; 0: none)."""
    values = flatten(update, layout)
    if bound is not None:
        norm = float(np.linalg.norm(values))
        if norm > bound:
            values = values * (bound / norm * (1 - 1e-9))
    if value_range is not None:
        values = np.clip(values, -value_range, value_range)
    if adaptive:
        values = np.append(values, float(update.info.get(UNCLIPPED_KEY, 0.0)))
    q = encode(values, params.ring, rng)
    if noise_std <= 0:
        return q
    assert params.ring.scale is not None
    share = discrete_gaussian(noise_std * params.ring.scale, q.size, rng)
    return ((q.astype(np.int64) + share) & np.int64(params.ring.modulus - 1)).astype(np.uint32)


def sum_update(ring_sum: np.ndarray, planned: PlannedSecure, layout: Layout, count: int,
               central: tuple[float, float] | None = None, rng: Any = None
               ) -> tuple[Update | None, float, str | None]:
    """(the decoded sum as an update at the common layout, the clip-bit sum, why refused or None): decoded
    and checked against the round's bounds (:func:`check_sum`).

    ``central``: a central-DP round's noise (:func:`central_noise`). It is added **before** the checks, from
    ``rng`` (default the CSPRNG), and the returned sum and bits carry it: whether a round is abandoned is
    published, so deciding on the un-noised sum would publish a function of it -- a hostile device masking a
    value at the edge of the bounds would learn from the abandonment whether an honest device's coordinate
    passed a threshold. Decided on the noised sum, the outcome is post-processing of the release the
    accountant composes."""
    params = planned.params
    noised = central is not None and (central[0] > 0 or central[1] > 0)
    try:
        total = decode_sum(ring_sum, params.ring, count, strict=not noised)
    except ValueError as exc:
        return None, 0.0, f"the unmasked sum is out of the ring's range ({exc})"
    extra = (0.0, 0.0)
    if noised:
        assert central is not None
        gen = csprng() if rng is None else rng
        std = np.full(total.size, central[0])
        if planned.adaptive:
            std[-1] = central[1]
        total = total + std * gen.normal(0.0, 1.0, total.size)
        extra = (9.0 * central[0], central[0] * (math.sqrt(params.length) + 6.0))  # as allowances(): 1e-8 each
    bits = None
    if planned.adaptive:
        total, bits = total[:-1], float(total[-1])
    assert params.ring.scale is not None
    per, l2 = allowances(count, params.length, params.ring.scale, planned.noise_std)
    # a noised clip-bit count is not range-checked: a count outside [0, count] moves C as one at its edge would
    # (next_clip keeps b_bar in [0, 1]), which one device can reach inside the range too
    why = check_sum(total, count, planned.bound, planned.value_range, (per + extra[0], l2 + extra[1]),
                    None if noised else bits)
    if why is not None:
        return None, 0.0, why
    return unflatten(total, layout, count), bits or 0.0, None


ABANDON_KINDS = ("too_few", "split", "shares", "sum_check", "restart", "other")


def abandon_kind(reason: str | None) -> str | None:
    """The kind of a secure round's abandon reason, for the records and the exporter's ``reason`` label: too few
    devices at a stage, a split survivors' graph, shares that rebuild nothing, a sum failing the checks, a
    coordinator restart, or other (None: not abandoned)."""
    if reason is None:
        return None
    for kind, marks in (("restart", ("restarted",)), ("too_few", ("fewer than t", "fewer than T", "needs >= 2",
                                                                                  "the unmasking needs")),
                        ("split", ("split",)), ("sum_check", ("unmasked sum", "clip-bit", "out of range")),
                        ("shares", ("shares of", "rebuild"))):
        if any(m in reason for m in marks):
            return kind
    return "other"


def drops_for(selected: tuple[str, ...], rate: float, seed: int, round_: int) -> dict[str, str]:
    """``flayer simulate``'s planned dropouts: each selected device drops with probability ``rate`` at a protocol
    step drawn uniformly (after its keys, its shares, its masked input -- no consent: left out -- or its consent)."""
    if rate <= 0:
        return {}
    rng = np.random.default_rng(derive_seed(seed, round_, "secagg-drops"))  # simulated dropouts: protects nothing
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


def plan_round(s: PrivacySettings, session: str, round_: int, participants: tuple[str, ...], layout: Layout,
               seed: int, rp: RoundPrivacy | None, norm_bound: float | None, stage_s: float | None = None,
               keep: float = 1.0) -> PlannedSecure:
    """A secure round's public plan: protocol parameters (:func:`round_params`), the contribution bounds
    (:func:`contribution_bounds`: the devices clip to them, the sum is checked against them), the noise shares,
    on the ``keep`` share of ``layout``'s positions (:mod:`flayer.engine.secure_fit`)."""
    bound, value_range = contribution_bounds(s, rp, norm_bound)
    layout = keep_layout(layout, keep, seed, round_)
    params, noise = round_params(s, session, round_, participants, layout, seed, rp, value_range)
    adaptive = s.enabled and s.clipping == "adaptive"
    _, _, value_bits = ring_noise(rp, params.threshold, params.length, ring_range(value_range, adaptive),
                                  len(participants), s.secure_value_bits)  # the resolution the ring was built at
    planned = PlannedSecure(params, layout.digest, adaptive, s.secure_stage_s if stage_s is None else stage_s, noise,
                            bound, value_range, corrupt_fraction(s), seed, value_bits, check_keep(keep),
                            float(s.secure_dropout))
    return planned.bind()


def secure_sum(s: PrivacySettings, session: str, round_: int, seed: int, uploads: Mapping[str, Update],
               bound: float | None, drops: Mapping[str, str] | None = None,
               rp: RoundPrivacy | None = None, seeded: bool = False) -> SecureSum:
    """Run a secure round in process over ``uploads`` (device id -> its upload) with ``drops`` (device -> the
    step it drops after), by the protocol code the coordinator runs: the sum of the survivors, decoded and
    checked (:func:`sum_update`), or the reason the round was abandoned. ``bound``: the federation's norm
    bound without DP (None: ``secure_clip_range``); the devices clip to the round's bounds
    (:func:`contribution_bounds`). ``rp``: the private round; in local mode the devices add their noise shares
    in the ring and the checks make room for them. The devices' entropy (keys, masks, rounding, noise) comes
    from the operating system's CSPRNG, as on a real device; ``seeded`` (``flayer simulate
    --dp-seeded-noise``: reproducible, not private) draws it from the run seed and the round instead."""
    from flayer.secagg import run_round

    participants = tuple(sorted(uploads))
    too_few = cohort_problem(len(participants), corrupt_fraction(s))
    if too_few is not None:
        return SecureSum(None, participants, (), f"{len(participants)} device(s) uploaded, fewer than t: {too_few}")
    full = common_layout(uploads)
    planned = plan_round(s, session, round_, participants, full, seed, rp, bound, keep=s.secure_keep)
    params, layout = planned.params, keep_layout(full, s.secure_keep, seed, round_)
    # seeded (--dp-seeded-noise) only for reproducible runs labelled not private: protects nothing; else the CSPRNG
    vectors = {dev: planned.vector(planned.fitted(up), layout, np.random.default_rng(derive_seed(  # protects nothing
        seed, round_, dev, "secagg")) if seeded else None) for dev, up in uploads.items()}
    run_seed = hashlib.sha256(f"secagg-run:{seed}:{round_}".encode()).digest() if seeded else secrets.token_bytes(32)
    out = run_round(params, vectors, drop_after=dict(drops or {}), seed=run_seed)  # type: ignore[arg-type]
    survivors, dropped = tuple(sorted(out.survivors)), tuple(sorted(set(participants) - set(out.survivors)))
    # seeded runs (labelled not private) leave the noise to the aggregator's seeded draw, to reproduce a plain run
    central = None if seeded else central_noise(rp)
    decode_only = out.ring_sum is not None and out.sum is None  # the protocol's own range check of the plain sum
    if out.ring_sum is None or (out.abandoned_reason is not None and not (decode_only and central is not None)):
        return SecureSum(None, survivors, dropped, out.abandoned_reason, 0.0, out.bytes_per_device,
                         out.messages_per_device)
    total, bits, why = sum_update(out.ring_sum, planned, layout, len(survivors), central)
    return SecureSum(total, survivors, dropped, why, bits, out.bytes_per_device, out.messages_per_device,
                     central is not None)


def plan_secure(planned: PlannedSecure) -> dict[str, Any]:
    """The plan's ``secure`` mapping: what every selected device needs to run the round's protocol
    (participants are the plan's ``selected``). The ring is not stated but for its width ``bits``: each device
    computes it from the value range, the resolution ``value_bits``, the noise and the cohort
    (:func:`round_ring`) and refuses a plan whose width is not the one it computes."""
    params = planned.params
    return {"session": params.session, "threshold": params.threshold, "degree": params.degree,
            "graph_seed": params.graph_seed.hex(), "length": params.length, "bits": params.ring.bits,
            "value_bits": planned.value_bits, "layout": planned.layout, "adaptive": planned.adaptive, "stage_s": planned.stage_s, "noise_std": planned.noise_std,
            "bound": planned.bound, "value_range": planned.value_range, "corrupt_fraction": planned.corrupt_fraction,
            "run_seed": planned.run_seed, "keep": planned.keep, "dropout": planned.dropout}


@dataclass(frozen=True)
class PlannedSecure:
    params: SecAggParams
    layout: str  # the digest of the round's common layout
    adaptive: bool  # the vector's last coordinate is the clip bit
    stage_s: float
    noise_std: float = 0.0  # distributed DP: each device's discrete Gaussian share, in value units (ring_noise)
    bound: float | None = None  # B: every device clips its upload's L2 norm to it (contribution_bounds)
    value_range: float | None = None  # per-coordinate range of the values (min(R, B))
    corrupt_fraction: float = 0.0  # the stated fraction of devices that may collude with the coordinator
    run_seed: int | None = None  # the run seed the graph seed is drawn from (devices recompute it)
    value_bits: int = 16  # the resolution of one device's value: with the range and the cohort, the ring's width
    keep: float = 1.0  # the share of the common positions masked (flayer.engine.secure_fit: drawn from the run seed)
    dropout: float = 0.1  # the dropout rate k and t were chosen for (devices recompute k's floor from it)
    plan: bytes = b""  # the round plan's other bound fields (protocol.plan_digest; b"": in process, one plan for all)

    def context(self) -> bytes:
        """The digest of this plan's facts beyond its protocol parameters (:func:`plan_context`)."""
        return plan_context(self.layout, self.adaptive, self.noise_std, self.bound, self.value_range, self.corrupt_fraction,
                            self.run_seed, self.value_bits, self.keep, self.dropout, self.plan)

    def bind(self, plan: bytes | None = None) -> PlannedSecure:
        """This round, its transcript's context (:meth:`context`) bound to ``plan`` (None: the digest it holds)."""
        out = self if plan is None else dataclasses.replace(self, plan=plan)
        return dataclasses.replace(out, params=dataclasses.replace(out.params, context=out.context()))

    def fitted(self, update: Update) -> Update:
        """``update`` (on the round's common positions) cut to the round's kept ones."""
        return restrict(update, self.keep, int(self.run_seed or 0), self.params.round)

    def vector(self, update: Update, layout: Layout, rng: np.random.Generator | KeystreamRandom | None = None
               ) -> np.ndarray:
        """A device's ring input for this round (:func:`device_vector` within the round's bounds); ``rng``
        None: the rounding and the noise from the operating system's CSPRNG."""
        return device_vector(update, layout, self.params, rng if rng is not None else csprng(), self.adaptive,
                             self.noise_std, self.bound, self.value_range)


def csprng() -> KeystreamRandom:
    """The generator of a device's secret-dependent draws (stochastic rounding, noise shares): the ChaCha20
    keystream under a fresh 256-bit key from ``os.urandom`` (:class:`flayer.secagg.prg.KeystreamRandom`)."""
    return KeystreamRandom(os.urandom(32))


def secure_from_plan(raw: Mapping[str, Any], round_: int, selected: tuple[str, ...],
                     min_corrupt_fraction: float = 0.0, privacy: Mapping[str, Any] | None = None,
                     plan_digest: bytes = b"") -> PlannedSecure | None:
    """A plan's secure round (None: not one); ValueError naming what is malformed or what this device refuses:
    a graph seed other than the one the run seed gives, a cohort, k or t below what this device computes itself
    from the cohort size, the plan's dropout and the colluding fraction (the plan's or ``min_corrupt_fraction``, the
    larger: :func:`flayer.engine.secure_plan.plan_floor_problem`, the coordinator's own rule), bounds that are not finite and positive, or -- with the plan's
    ``privacy`` in local mode (distributed DP: the devices' shares are the round's only noise) -- a noise share
    below ``max(z, z_Delta) C / sqrt(t)``, the least that gives t shares the noise the device's ledger books.
    ``plan_digest``: the plan's other bound fields, in the transcript (:func:`protocol.plan_digest.plan_digest`)."""
    if not raw:
        return None
    try:
        bits, value_bits = int(raw["bits"]), int(raw["value_bits"])
        seed = bytes.fromhex(str(raw["graph_seed"]))
        stage_s = float(raw.get("stage_s", 10.0))
        noise_std = float(raw.get("noise_std", 0.0))
        layout = str(raw["layout"])
        bound, value_range = float(raw["bound"]), float(raw["value_range"])
        gamma = float(raw.get("corrupt_fraction", 0.0))
        run_seed = raw["run_seed"]
        adaptive = bool(raw.get("adaptive", False))
        keep = check_keep(raw.get("keep", 1.0))
        dropout = float(raw["dropout"])
        if not all(math.isfinite(v) and 0 < v <= 1e9 for v in (bound, value_range)):
            raise ValueError(f"bound {bound} and value_range {value_range} must be finite and > 0")
        if not (0 <= noise_std <= 1e6 and math.isfinite(noise_std)):
            raise ValueError(f"noise_std {noise_std}")
        # the ring every device computes from the plan's range, resolution, noise and cohort
        ring = round_ring(ring_range(value_range, adaptive), len(selected), value_bits, noise_std)
        params = SecAggParams(str(raw["session"]), round_, tuple(selected), int(raw["threshold"]), int(raw["degree"]),
                              seed, int(raw["length"]), ring)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"plan: malformed secure-round parameters ({exc})") from None
    if len(layout) != 64 or not (0 < stage_s <= 86_400):
        raise ValueError("plan: malformed secure-round parameters (layout digest or stage_s)")
    if not (0 <= gamma < 0.5 and 0 <= dropout < 0.5) or not isinstance(run_seed, int) or isinstance(run_seed, bool):
        raise ValueError("plan: malformed secure-round parameters (corrupt_fraction, dropout or run_seed)")
    if bits != ring.bits:
        raise ValueError(f"plan: the secure round's ring is {bits} bits wide; its value range {value_range:g}, "
                         f"resolution {value_bits} bits, noise and {len(selected)} devices need {ring.bits}: refused")
    if seed != graph_seed_of(run_seed, round_):
        raise ValueError("plan: the secure round's graph seed is not the one the run seed and the round give: "
                         "refused (a coordinator choosing the graph could pick who neighbours whom)")
    why = plan_floor_problem(len(params.participants), params.degree, params.threshold, dropout,
                             max(gamma, min_corrupt_fraction))
    if why is not None:
        raise ValueError(f"plan: {why}: refused")
    check_noise(privacy, params.threshold, noise_std, params.length, ring.scale)
    planned = PlannedSecure(params, layout, adaptive, stage_s, noise_std, bound, value_range, gamma, run_seed,
                            value_bits, keep, dropout)
    return planned.bind(plan_digest)

