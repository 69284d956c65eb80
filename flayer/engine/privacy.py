"""Client-level differential privacy in the round engine (docs/explanation/privacy.md).

DP-FedAvg (McMahan et al., ICLR 2018; Andrew et al., NeurIPS 2021), written once for every driver:

1. **Clip on the device.** The upload Delta_k (every tensor that leaves device k: its sparse or dense
   deltas; personal layers never leave it and are outside the guarantee) is scaled to
   ``Delta_k * min(1, C / ||Delta_k||_2)`` (:func:`clip_upload`).
2. **Noise.** ``central``: the coordinator adds ``N(0, (z C)^2)`` to every coordinate of the round's
   SUM (:func:`central_std`), drawn from a generator keyed by the operating system's CSPRNG (a seed a
   plan reader knows would let it subtract the noise). ``local``: each device adds its share
   ``N(0, (z C)^2 / m)`` to its own clipped upload (:func:`local_share_std`), with ``m`` the expected
   number of contributions, so the sum of ``m`` shares carries variance ``(z C)^2``.
3. **Fixed denominator.** The next model is ``prev + (sum_k clip(Delta_k) + noise) / m``, unweighted,
   with ``m`` fixed before the round (:class:`flayer.aggregate.DPSumAggregator`): one device changes
   the sum by at most C, so the sensitivity is C whatever the others send.
4. **The coordinator re-clips.** Device-side clipping is not trusted: the coordinator bounds what it
   folds at :func:`server_bound` (C in central mode; C plus a bound on the noise norm in local mode).
5. **Adaptive clipping** (Andrew et al. 2021, the rule Flower's adaptive-clipping wrappers implement):
   each device reports ``b_k = 1[||Delta_k|| <= C]``; the coordinator sums the bits centred at +-1/2,
   ``sum_k (b_k - 1/2)``, adds ``N(0, sigma_b^2)`` and sets ``C <- C * exp(-eta (b_bar - gamma))`` with
   ``b_bar`` the noised sum over ``m`` plus 1/2, kept in [0, 1] (:func:`next_clip`). **Sensitivity 1.** Under
   the zero-out neighbour relation the privacy page states, the neighbour of a device whose update is clipped
   (bit 0) is the same device uploading zeros -- whose norm 0 is within C, bit 1: one device moves the centred
   count by 1, not the 1/2 that add/remove neighbours would give (:data:`BIT_SENSITIVITY`). The update noise
   therefore uses ``z_Delta = (z^-2 - sigma_b^-2)^(-1/2)`` (:func:`adaptive_update_multiplier`), so that the two
   releases together are one Gaussian mechanism of multiplier ``z`` (:func:`combined_multiplier`, Andrew et
   al. Thm 1 with the bits' sensitivity 1), and ``sigma_b`` must exceed ``z``.

Whatever a plan's ``noise_multiplier`` label says, every ledger composes the multiplier the plan's *named*
noises give (:attr:`RoundPrivacy.named_multiplier`: the update noise, and with adaptive clipping the bit noise
too); a device refuses a plan whose label and named noises disagree (:meth:`RoundPrivacy.noise_problem`).

:class:`flayer.privacy_config.PrivacySettings` is the ``[privacy]`` table; :class:`RoundPrivacy` is what one round's devices
and coordinator need (it travels in the round plan's ``privacy`` mapping).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from flayer.privacy_config import CLIP_SPLITS, PrivacySettings
from flayer.strategies.base import Strategy
from flayer.update import TensorDelta, Update

__all__ = ["BIT_SENSITIVITY", "REPORTED", "UNCLIPPED_KEY", "PrivacySettings", "RoundPrivacy",
           "adaptive_update_multiplier", "central_std", "clip_upload", "layer_bounds", "layer_of", "combined_multiplier", "local_share_std", "next_clip", "private_strategy", "privatize", "server_bound",
           "upload_norm"]

UNCLIPPED_KEY = "dp_unclipped"  # the device's clip bit b_k in Update.info (adaptive clipping)
# what a private upload still reports beside its deltas: the evaluation counts the round record shows
# (outside the guarantee, docs/explanation/privacy.md); a strategy's own entries (FLAYER's acc_val) are dropped
REPORTED = frozenset({"test_correct", "test_total", "train_loss"})


def central_std(z: float, clip: float) -> float:
    """Std of the noise the coordinator adds to each coordinate of the round's sum: ``z * C``."""
    return z * clip


def local_share_std(z: float, clip: float, m: int) -> float:
    """Std of one device's share in local mode: ``z * C / sqrt(m)``, so that the sum of the ``m``
    expected contributions carries ``N(0, (z C)^2)``: ``m * (z C / sqrt(m))^2 = (z C)^2``."""
    return z * clip / math.sqrt(m)


# how far one device moves the clip-bit count under zero-out neighbours: a clipped update reports 0, the zero
# upload of its neighbour 1 (module docstring, rule 5)
BIT_SENSITIVITY = 1.0
LABEL_TOLERANCE = 1e-6  # relative: a plan's noise_multiplier label and its named noises agree within float rounding
MIN_MULTIPLIER = 0.01  # below it a plan names no noise a device can count (one round: epsilon in the thousands)
CLIP_RANGE = (1e-6, 1e6)  # C outside it is refused: a subnormal C rounds the float32 upload past C


def adaptive_update_multiplier(z: float, bit_std: float) -> float:
    """Andrew et al. 2021 with the clip bits' sensitivity 1 (:data:`BIT_SENSITIVITY`): the update noise
    multiplier ``z_Delta = (z^-2 - sigma_b^-2)^(-1/2)`` that, together with the clip-bit count noised at
    ``sigma_b``, costs a Gaussian mechanism of multiplier z; ValueError when ``sigma_b <= z``."""
    if z <= 0:
        return 0.0
    inner = z ** -2 - (bit_std / BIT_SENSITIVITY) ** -2 if bit_std > 0 else -1.0
    if inner <= 0:
        raise ValueError(f"noise_multiplier {z:g} must be below count_stddev = {bit_std:g} (one device moves the "
                         f"clip-bit count by {BIT_SENSITIVITY:g})")
    return inner ** -0.5


def combined_multiplier(update_multiplier: float, bit_std: float) -> float:
    """The multiplier of the one Gaussian mechanism that releases the round's sum (noise ``z_Delta C``,
    sensitivity C) and the clip-bit count (noise ``sigma_b``, sensitivity 1) together:
    ``(z_Delta^-2 + (sigma_b / 1)^-2)^(-1/2)`` (Gaussian DP: the mu's add in squares); 0 when either release
    carries no noise (no guarantee)."""
    if update_multiplier <= 0 or bit_std <= 0:
        return 0.0
    return (update_multiplier ** -2 + (bit_std / BIT_SENSITIVITY) ** -2) ** -0.5


def next_clip(clip: float, noised_bits: float, m: int, target_quantile: float, lr: float) -> float:
    """Andrew et al. 2021, geometric update: ``C <- C * exp(-eta (b_bar - gamma))`` with ``b_bar`` the
    noised count of unclipped updates over m, kept in [0, 1] (more unclipped than gamma: C shrinks)."""
    return clip * math.exp(-lr * (min(1.0, max(0.0, noised_bits / m)) - target_quantile))


def _squares(update: Update) -> dict[str, float]:
    """Each tensor's float64 sum of squares, in the update's order."""
    out = {}
    for k, d in update.deltas.items():
        v = d.values.astype(np.float64)
        out[k] = float(np.dot(v, v))
    return out


def upload_norm(update: Update) -> float:
    """L2 norm of everything an update carries (float64 sum of squares)."""
    return math.sqrt(sum(_squares(update).values()))


def layer_of(tensor: str) -> str:
    """The layer a tensor belongs to: its name without the last dotted part (``fc1.0.weight`` and ``fc1.0.bias``
    are layer ``fc1.0``), a fact of the model's names, the same on every device."""
    return tensor.rsplit(".", 1)[0] if "." in tensor else tensor


def layer_bounds(update: Update, clip: float, split: str) -> dict[str, float]:
    """Per-layer clip bounds ``C_i`` with ``sum_i C_i^2 = C^2`` over the layers ``update`` carries
    (:data:`flayer.privacy_config.CLIP_SPLITS`): ``sqrt``, ``C_i = C sqrt(n_i / n)`` with ``n_i`` the coordinates
    layer i uploads (public: private rounds upload at public positions), so every coordinate gets the same share
    ``C^2 / n``; ``equal``, ``C_i = C / sqrt(L)`` over the L layers. Neither reads a value of the update."""
    counts: dict[str, int] = {}
    for k, d in update.deltas.items():
        counts[layer_of(k)] = counts.get(layer_of(k), 0) + int(d.values.size)
    if split == "equal":
        return {layer: clip / math.sqrt(len(counts)) for layer in counts}
    if split == "sqrt":
        total = sum(counts.values())
        return {layer: clip * math.sqrt(n / total) if total else 0.0 for layer, n in counts.items()}
    raise ValueError(f"clip_split must be one of {', '.join(CLIP_SPLITS)} here, got {split!r}")


def clip_upload(update: Update, clip: float, split: str = "total") -> tuple[Update, float]:
    """(``update`` clipped, its norm before clipping). ``total``: scaled by ``min(1, C / ||update||)``. ``sqrt`` or
    ``equal``: each layer i scaled by ``min(1, C_i / ||Delta_i||)`` with ``sum_i C_i^2 = C^2``
    (:func:`layer_bounds`), so ``||clip(Delta)||^2 = sum_i ||clip_i(Delta_i)||^2 <= sum_i C_i^2 = C^2``: the same
    sensitivity C, whatever the update. Each scale is a hair under ``C_i / ||Delta_i||`` so that the float32
    values come out at most C: the coordinator clips again to C and counts what it scales down, and that count
    must not say whose update was over C."""
    tensors = _squares(update)
    norm = math.sqrt(sum(tensors.values()))  # upload_norm's, summed once here
    if split == "total":
        if norm <= clip:
            return update, norm
        f = clip / norm * (1 - 1e-6)
        return Update({k: d.scaled(f) for k, d in update.deltas.items()}, update.num_samples, update.info), norm
    bounds = layer_bounds(update, clip, split)
    squares: dict[str, float] = {}
    for k, sq in tensors.items():
        squares[layer_of(k)] = squares.get(layer_of(k), 0.0) + sq
    factors = {layer: 1.0 if math.sqrt(sq) <= bounds[layer] else bounds[layer] / math.sqrt(sq) * (1 - 1e-6)
               for layer, sq in squares.items()}
    if all(f == 1.0 for f in factors.values()):
        return update, norm
    deltas = {k: d if factors[layer_of(k)] == 1.0 else d.scaled(factors[layer_of(k)])
              for k, d in update.deltas.items()}
    return Update(deltas, update.num_samples, update.info), norm


@dataclass(frozen=True)
class RoundPrivacy:
    """One round's DP parameters, what devices and coordinator agree on (the plan's ``privacy`` mapping)."""

    mode: Literal["central", "local"]
    clip: float  # C of this round
    noise_multiplier: float  # z the accountant composes
    update_multiplier: float  # z_Delta: the multiplier of the update noise (z without adaptive clipping)
    contributions: int  # m: the fixed denominator and the local share's divisor
    adaptive: bool = False
    bit_std: float = 0.0  # adaptive: sigma_b, the noise on the clip-bit count
    ring: bool = False  # local mode in a secure round: the shares are discrete Gaussian, in the ring (flayer.engine.secure)
    clip_split: str = "total"  # how C is spent over the upload's layers (clip_upload; CLIP_SPLITS); a plan without it: total

    @classmethod
    def of(cls, s: PrivacySettings, clip: float | None = None) -> RoundPrivacy:
        assert s.expected_contributions is not None, "resolve() the settings first"
        adaptive = s.clipping == "adaptive"
        zu = adaptive_update_multiplier(s.noise_multiplier, s.bit_stddev) if adaptive else s.noise_multiplier
        return cls(s.mode, s.clip if clip is None else clip, s.noise_multiplier, zu, s.expected_contributions,
                   adaptive, s.bit_stddev if adaptive else 0.0, clip_split=s.clip_split)

    @property
    def named_multiplier(self) -> float:
        """The multiplier the plan's named noises give (module docstring): ``update_multiplier``, combined with the
        bit noise under adaptive clipping (:func:`combined_multiplier`). What every ledger composes; 0 when a
        named noise is zero."""
        if self.adaptive:
            return combined_multiplier(self.update_multiplier, self.bit_std)
        return self.update_multiplier

    @property
    def counted_multiplier(self) -> float:
        """What a ledger composes for a round's sum: the named multiplier, never more than the label."""
        return min(self.noise_multiplier, self.named_multiplier)

    def noise_problem(self) -> str | None:
        """Why this plan's noise cannot be counted as it is labelled (None: it can): a named noise that is zero,
        or a ``noise_multiplier`` label that the named noises do not give (a plan labelled z = 1000 with update
        noise 0 would otherwise be booked as nearly free)."""
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            return f"its noise_multiplier is {self.noise_multiplier:g}: no noise"
        if not (self.update_multiplier > 0 and math.isfinite(self.update_multiplier)):
            return f"its update noise multiplier is {self.update_multiplier:g}: no noise on the update"
        if self.adaptive and not (self.bit_std > 0 and math.isfinite(self.bit_std)):
            return f"adaptive clipping with clip-bit noise {self.bit_std:g}: the clip bits would go out un-noised"
        named = self.named_multiplier
        if abs(named - self.noise_multiplier) > LABEL_TOLERANCE * max(1.0, self.noise_multiplier):
            what = (f"update noise {self.update_multiplier:.6g} and clip-bit noise {self.bit_std:.6g}" if self.adaptive
                    else f"update noise {self.update_multiplier:.6g}")
            return (f"its label noise_multiplier {self.noise_multiplier:.6g} is not what its {what} give "
                    f"({named:.6g})")
        if self.named_multiplier < MIN_MULTIPLIER:
            return (f"the noise it names gives a multiplier of {self.named_multiplier:.3g}, below {MIN_MULTIPLIER:g}: "
                    f"no noise a device can count")
        return None

    @property
    def sum_std(self) -> float:
        """Std of the noise on each coordinate of the round's sum: ``z_Delta * C``."""
        return central_std(self.update_multiplier, self.clip)

    @property
    def share_std(self) -> float:
        """Local mode: each device's share (:func:`local_share_std`); central, or shares drawn in the ring: 0."""
        if self.mode != "local" or self.ring:
            return 0.0
        return local_share_std(self.update_multiplier, self.clip, self.contributions)

    def as_plan(self) -> dict[str, float | int | str | bool]:
        return {"mode": self.mode, "clip": self.clip, "noise_multiplier": self.noise_multiplier,
                "update_multiplier": self.update_multiplier, "contributions": self.contributions,
                "adaptive": self.adaptive, "bit_std": self.bit_std, "ring": self.ring,
                **({} if self.clip_split == "total" else {"clip_split": self.clip_split})}

    @classmethod
    def from_plan(cls, raw: Mapping[str, Any]) -> RoundPrivacy | None:
        """The round's parameters from a plan (None: not a private round); ValueError when malformed."""
        if not raw:
            return None
        flags = {k: raw.get(k, False) for k in ("adaptive", "ring")}
        bad = [k for k, v in flags.items() if not isinstance(v, bool)]
        if bad:  # bool("false") is True: a flag is a JSON boolean or the plan is malformed
            raise ValueError(f"plan: privacy {bad[0]} must be true or false, got {raw.get(bad[0])!r}")
        try:
            out = cls(str(raw["mode"]), float(raw["clip"]), float(raw["noise_multiplier"]),  # type: ignore[arg-type]
                      float(raw["update_multiplier"]), int(raw["contributions"]), flags["adaptive"],
                      float(raw.get("bit_std", 0.0)), flags["ring"], raw.get("clip_split", "total"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"plan: malformed privacy parameters ({exc})") from None
        if out.mode not in ("central", "local") or not CLIP_RANGE[0] <= out.clip <= CLIP_RANGE[1] \
                or not all(v >= 0 and math.isfinite(v) for v in (out.noise_multiplier, out.update_multiplier,
                                                                   out.bit_std)) or out.contributions < 1 \
                or out.clip_split not in CLIP_SPLITS:
            raise ValueError(f"plan: privacy parameters out of range: {dict(raw)}")
        return out


def privatize(update: Update, rp: RoundPrivacy, rng: np.random.Generator | None) -> Update:
    """The device side of a private round: clip to C, record the clip bit (adaptive clipping), and in
    local mode add this device's noise share to every value it sends. ``rng``: the device's own
    generator (a real device draws it from the operating system; the simulator seeds it); None where
    the device adds no noise (central mode), and a ValueError where it must."""
    clipped, norm = clip_upload(update, rp.clip, rp.clip_split)
    info = {k: v for k, v in update.info.items() if k in REPORTED}
    if rp.adaptive:
        info[UNCLIPPED_KEY] = 1.0 if norm <= rp.clip else 0.0
    std = rp.share_std
    deltas = clipped.deltas
    if std > 0:
        if rng is None:
            raise ValueError("a private round whose devices add noise needs the device's noise generator")
        deltas = {k: TensorDelta(d.shape, (d.values.astype(np.float64) + rng.normal(0.0, std, d.values.size))
                                 .astype(np.float32), d.indices) for k, d in clipped.deltas.items()}
    return Update(deltas, update.num_samples, info)


def server_bound(rp: RoundPrivacy, coordinates: int) -> float:
    """What the coordinator clips every update to (device clipping is not trusted). Central: C. Local:
    the device's share adds a noise vector of norm about ``s sqrt(d)`` over the ``d`` coordinates it may
    send; the bound is ``C + 2 s sqrt(d)`` (the noise norm's std is about ``s / sqrt(2)``, so an honest
    update is never cut), which still caps what one device moves the sum by."""
    if rp.mode == "central":
        return rp.clip
    return rp.clip + 2.0 * rp.share_std * math.sqrt(max(1, coordinates))


def private_strategy(strategy: Strategy) -> Strategy:
    """``strategy`` as a private round runs it -- sparse positions drawn from the round's public seed
    (option ``positions = "public"``) -- or ValueError naming the option DP cannot honour."""
    if strategy.needs_calibration():
        raise ValueError(f"strategy {strategy.name}: a calibration round (head_layers = \"auto\", PLayer-FL's "
                         f"split) reports each device's sensitivity curve without noise; set the split explicitly "
                         f"for a private federation")
    if strategy.server_rule() != "carry":
        raise ValueError(f"strategy {strategy.name}: server_rule {strategy.server_rule()!r} cannot be used with "
                         f"privacy: private rounds aggregate a noised sum over a fixed denominator "
                         f"(flayer.aggregate.DPSumAggregator); leave server_rule = \"carry\"")
    opts = strategy.options_dict()
    if "positions" not in opts:
        return strategy
    if opts["positions"] == "topk" and opts.get("masks", True):
        raise ValueError(f"strategy {strategy.name}: positions = \"topk\" chooses each device's upload positions "
                         f"from its own data; private rounds need positions = \"public\" (or unset)")
    return strategy.with_options({"positions": "public"})
