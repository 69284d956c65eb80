"""``[privacy]``: the settings of client-level differential privacy, validated once (docs/reference/configuration.md).

A leaf module (the run config reads it); the mechanism is :mod:`flayer.engine.privacy`, the accountant
:mod:`flayer.engine.accountant`. ``resolve`` fills in what follows from the federation (population N,
expected contributions m, delta = min(1e-5, 1/(10 N))) and refuses what cannot hold (delta >= 1/N, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["AUTO_LR_RANGE", "AUTO_NOISE_REF", "CLIP_SPLITS", "SERVER_LR_RANGE", "ParticipationSchema", "PrivacySettings",
           "auto_server_lr", "check_server_step", "default_delta"]

NOISE_KINDS = ("independent", "banded")  # flayer.engine.correlated
# how a device spends C over its upload (flayer.engine.privacy.clip_upload): one bound on the whole upload, or a
# bound C_i a layer with sum_i C_i^2 = C^2, C_i proportional to sqrt(the layer's uploaded coordinates), or equal
CLIP_SPLITS = ("total", "sqrt", "equal")
MAX_BANDS = 64
SERVER_LR_RANGE = (1e-3, 100.0)  # eta outside it is refused: 0 freezes the model, a huge eta multiplies the noise
# server_lr = "auto": eta = sqrt(AUTO_NOISE_REF / (z C / m)) within AUTO_LR_RANGE, from the noise on the average. On
# Fashion-MNIST the plain step was the best measured at z C / m = 0.028 (100 devices, epsilon 8 every round), 1.25
# to 1.5 at 0.016 (the same under a schema of 3), 3 at 0.002 (1,000 devices) and 1 at 0.052 (epsilon 2): the rule
# passes through them (docs/results/privacy.md, "The server step by the noise on the average")
AUTO_NOISE_REF = 0.03
AUTO_LR_RANGE = (1.0, 3.0)


def auto_server_lr(noise_multiplier: float, clip: float, contributions: int) -> float:
    """The server step's eta for ``server_lr = "auto"``: sqrt(AUTO_NOISE_REF / (z C / m)) clamped to AUTO_LR_RANGE
    and rounded to 2 decimals; the longest step (3) without noise. Public facts only (z, C, m are in every plan)."""
    lo, hi = AUTO_LR_RANGE
    sigma = noise_multiplier * clip / max(1, contributions)
    eta = hi if sigma <= 0 else min(hi, max(lo, math.sqrt(AUTO_NOISE_REF / sigma)))
    return round(eta, 2)


def check_server_step(lr: object, momentum: object, allow_auto: bool = False) -> None:
    """ValueError naming the bad value unless ``lr`` (the server step's eta) is a finite number in
    SERVER_LR_RANGE (or, with ``allow_auto``, "auto": a setting that :meth:`PrivacySettings.resolve` turns into a
    number) and ``momentum`` (beta) a finite number in [0, 1) (:mod:`flayer.engine.server_step`)."""
    lo, hi = SERVER_LR_RANGE
    if allow_auto and lr == "auto":
        lr = 1.0
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lo <= lr <= hi):
        auto = '"auto" or ' if allow_auto else ""
        raise ValueError(f"server_lr must be {auto}a finite number in [{lo:g}, {hi:g}], got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
            or not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
        raise ValueError(f"server_momentum must be a finite number in [0, 1), got {momentum!r}")


def default_delta(population: int) -> float:
    """``delta = min(1e-5, 1 / (10 N))``. delta bounds the chance that the guarantee fails outright: a
    mechanism that publishes each device's data whole with probability delta is (0, delta)-DP and leaks
    N delta devices on average, so delta must sit well below 1/N (here N delta <= 0.1 at any N), and no
    larger than 1e-5 in a small federation, where 1/(10 N) alone would be a sizeable chance (1/40 for
    four devices). 1e-5 is the value Flower's and Opacus's examples use."""
    return min(1e-5, 0.1 / float(population))


@dataclass(frozen=True)
class ParticipationSchema:
    """A public rule on who may be selected (docs/explanation/privacy.md, "The participation schema"): each
    device takes part at most ``most`` times over the run (None: no limit) and ``separation`` rounds apart at
    least (a device last selected in round r may be selected again from round r + separation; 0 or 1: no gap).
    Participation is being named in a plan's cohort, which anyone reading the plans can count."""

    most: int | None = None
    separation: int = 0

    def __post_init__(self) -> None:
        if self.most is not None and (isinstance(self.most, bool) or not isinstance(self.most, int) or self.most < 1):
            raise ValueError(f"max_participations must be an integer >= 1, got {self.most!r}")
        if isinstance(self.separation, bool) or not isinstance(self.separation, int) or not 0 <= self.separation <= 10**6:
            raise ValueError(f"min_separation must be an integer in [0, 1000000], got {self.separation!r}")

    @property
    def active(self) -> bool:
        return self.most is not None or self.separation > 1

    def refuses(self, taken: list[int] | tuple[int, ...], round_: int) -> str | None:
        """Why a device that took part in rounds ``taken`` (ascending) may not take part in ``round_`` (None: it may)."""
        return self.refuses_count(len(taken), taken[-1] if taken else None, round_)

    def refuses_count(self, count: int, last: int | None, round_: int) -> str | None:
        """:meth:`refuses` from how many rounds a device took part in and the last of them."""
        if self.most is not None and count >= self.most:
            return f"it took part in {count} round(s) already, max_participations = {self.most}"
        if last is not None and round_ - last < self.separation:
            return (f"its last participation was round {last}, {round_ - last} round(s) before round "
                    f"{round_}; min_separation = {self.separation}")
        return None

    def looser_than(self, floor: ParticipationSchema) -> str | None:
        """Why this schema (a plan's) allows more than ``floor`` (a device's pinned one), or None."""
        if floor.most is not None and (self.most is None or self.most > floor.most):
            return (f"the plan's max_participations {self.most if self.most is not None else 'none'} is looser than "
                    f"the {floor.most} this device pins")
        if self.separation < floor.separation:
            return (f"the plan's min_separation {self.separation} is looser than the {floor.separation} this device "
                    f"pins")
        return None

    def tightest(self, other: ParticipationSchema) -> ParticipationSchema:
        mosts = [m for m in (self.most, other.most) if m is not None]
        return ParticipationSchema(min(mosts) if mosts else None, max(self.separation, other.separation))

    def as_plan(self) -> dict[str, int]:
        """The plan's privacy keys (absent: no limit)."""
        out = {"min_separation": self.separation}
        if self.most is not None:
            out["max_participations"] = self.most
        return out

    @classmethod
    def from_plan(cls, raw: Mapping[str, Any]) -> ParticipationSchema:
        """The schema a plan's privacy mapping names; ValueError when malformed."""
        most, sep = raw.get("max_participations"), raw.get("min_separation", 0)
        try:
            return cls(most, sep)
        except ValueError as exc:
            raise ValueError(f"plan: privacy {exc}") from None

    def short(self, rounds: int | None = None) -> str:
        """The schema in a few words, for a console line or a metric's label: ``every round``, or ``k in N rounds,
        b apart`` (``at most k rounds, b apart`` without the run's ``rounds``)."""
        if self.most is None:
            return "every round"
        head = f"at most {self.most} rounds" if rounds is None else f"{self.most} in {rounds} rounds"
        return head + (f", {self.separation} apart" if self.separation > 1 else "")

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> ParticipationSchema:
        """The schema a private round record names (``dp_max_participations``, ``dp_min_separation``); a record
        without them, or with values no schema takes: every round."""
        try:
            return cls(record.get("dp_max_participations"), int(record.get("dp_min_separation") or 0))
        except (TypeError, ValueError):
            return cls()

    def describe(self) -> str:
        """How a printed epsilon names the schema it assumes."""
        if self.most is None:
            return "a device in every round (no max_participations)"
        gap = f", {self.separation} rounds apart" if self.separation > 1 else ""
        return f"a device in at most {self.most} round{'' if self.most == 1 else 's'}{gap} (the participation schema)"


@dataclass(frozen=True)
class PrivacySettings:
    """``[privacy]``: client-level differential privacy (module docstring). Off unless ``enabled``."""

    enabled: bool = False
    mode: Literal["central", "local"] = "central"  # who adds the noise: the coordinator, or each device a share
    # C: L2 bound on a device's upload (the initial C with adaptive clipping). 0.3: on Fashion-MNIST, 100 devices,
    # 20 a round, 10 rounds at epsilon 8, C = 1 diverged and 0.03 / 0.1 learned less (docs/results/privacy.md)
    clip: float = 0.3
    noise_multiplier: float = 1.0  # z: the noise std on the round's sum is z * C
    delta: float | None = None  # the delta epsilon is reported at; default min(1e-5, 1/(10 N)); must be < 1/N
    target_epsilon: float | None = None  # stop the federation before epsilon would exceed it
    clipping: Literal["fixed", "adaptive"] = "fixed"
    target_quantile: float = 0.5  # adaptive: gamma, the fraction of updates left unclipped
    clip_lr: float = 0.2  # adaptive: eta of the geometric update (Andrew et al. recommend 0.2)
    # C over the whole upload, or a bound a layer (CLIP_SPLITS). sqrt: on Fashion-MNIST, 100 devices, 20 a round,
    # 10 rounds, max_participations 3, FLAYER at epsilon 8 gained on validation on each of 3 seeds over total
    # (docs/results/privacy.md, "The clip's cost")
    clip_split: Literal["total", "sqrt", "equal"] = "sqrt"
    count_stddev: float | None = None  # adaptive: sigma_b on the clip-bit count; default max(m / 20, 2 z)
    population: int | None = None  # N, the devices that could be selected (coordinator: required)
    expected_contributions: int | None = None  # m, the fixed denominator; default: who a round asks
    # the server step on the noised average, post-processing (no epsilon): flayer.engine.server_step
    # eta in [0.001, 100]: next = prev + eta * v (1: the plain average); "auto": eta = sqrt(0.03 / (z C / m)) within
    # [1, 3], from the noise on the average, set when the federation starts (auto_server_lr)
    server_lr: float | Literal["auto"] = "auto"
    server_momentum: float = 0.0  # beta in [0, 1): v <- beta * v + (sum + noise) / m, carried across rounds
    device_budget: float | None = None  # each device refuses private rounds past this epsilon of its own (q = 1)
    # the participation schema (ParticipationSchema): each device selected at most k times, b rounds apart at least
    max_participations: int | None = None
    min_separation: int = 0
    # the central noise's kind (flayer.engine.correlated): a fresh draw each round, or banded correlated noise
    # (DP-MF) with noise_bands bands; banded needs the schema above with min_separation >= noise_bands
    noise_kind: Literal["independent", "banded"] = "independent"
    noise_bands: int = 1
    # secure aggregation (SecAgg+, docs/explanation/secure-aggregation.md): the coordinator learns only the
    # round's sum; with or without the DP above (``enabled``)
    secure_aggregation: bool = False
    secure_clip_range: float | None = None  # R: each sent value is clipped to [-R, R]; default C with DP, else 8
    secure_dropout: float = 0.1  # the dropout rate k and t are chosen to survive (emulate: from the profiles if unset)
    secure_corrupt_fraction: float = 0.0  # devices that may collude with the coordinator: t's floor (devices check)
    secure_stage_s: float = 10.0  # coordinator: how long the key, share and unmask stages each wait for devices
    secure_value_bits: int = 16  # resolution of one device's value over [-R, R]: with the cohort, the ring's width
    secure_fit_factor: float = 1.2  # a masked input at most this x the plain link fit's bytes at the same budget
    secure_keep: float = 1.0  # the most of the round's common positions a masked input keeps (simulate: the fraction)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and 1e-6 <= self.clip <= 1e6):
            raise ValueError(f"clip (C) must be a finite number in [1e-6, 1e6], got {self.clip}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier (z) must be a finite number >= 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None:
            if not (math.isfinite(self.target_epsilon) and self.target_epsilon > 0):
                raise ValueError(f"target_epsilon must be a finite number > 0, got {self.target_epsilon}")
            if self.noise_multiplier <= 0:
                raise ValueError("target_epsilon needs noise: noise_multiplier (z) must be > 0 (z = 0 spends an "
                                 "infinite epsilon in the first round)")
        check_server_step(self.server_lr, self.server_momentum, allow_auto=True)
        if self.device_budget is not None and not (math.isfinite(self.device_budget) and self.device_budget > 0):
            raise ValueError(f"device_budget must be a finite epsilon > 0, got {self.device_budget}")
        ParticipationSchema(self.max_participations, self.min_separation)  # ValueError naming the bad value
        if self.clip_split not in CLIP_SPLITS:
            raise ValueError(f"clip_split must be one of {', '.join(CLIP_SPLITS)}, got {self.clip_split!r}")
        if self.noise_kind not in NOISE_KINDS:
            raise ValueError(f"noise_kind must be one of {', '.join(NOISE_KINDS)}, got {self.noise_kind!r}")
        if isinstance(self.noise_bands, bool) or not isinstance(self.noise_bands, int) \
                or not 1 <= self.noise_bands <= MAX_BANDS:
            raise ValueError(f"noise_bands must be an integer in [1, {MAX_BANDS}], got {self.noise_bands!r}")
        if self.enabled and (why := self.correlated_problem()) is not None:
            raise ValueError(why)
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile}")
        if not (math.isfinite(self.clip_lr) and self.clip_lr > 0):
            raise ValueError(f"clip_lr must be a finite number > 0, got {self.clip_lr}")
        if self.count_stddev is not None and not (math.isfinite(self.count_stddev) and self.count_stddev > 0):
            raise ValueError(f"count_stddev must be a finite number > 0, got {self.count_stddev}")
        if self.population is not None and self.population < 2:
            raise ValueError(f"population must be >= 2, got {self.population}")
        if self.expected_contributions is not None and self.expected_contributions < 1:
            raise ValueError(f"expected_contributions must be >= 1, got {self.expected_contributions}")
        if self.secure_clip_range is not None and not (math.isfinite(self.secure_clip_range)
                                                       and 0 < self.secure_clip_range <= 1e6):
            raise ValueError(f"secure_clip_range must be a finite number in (0, 1e6], got {self.secure_clip_range}")
        if not (math.isfinite(self.secure_stage_s) and 0.1 <= self.secure_stage_s <= 3600):
            raise ValueError(f"secure_stage_s must be in [0.1, 3600] seconds, got {self.secure_stage_s}")
        if not 0 <= self.secure_corrupt_fraction < 0.5:
            raise ValueError(f"secure_corrupt_fraction must be in [0, 0.5), got {self.secure_corrupt_fraction}")
        if isinstance(self.secure_value_bits, bool) or not isinstance(self.secure_value_bits, int) \
                or not 8 <= self.secure_value_bits <= 30:
            raise ValueError(f"secure_value_bits must be an integer in [8, 30], got {self.secure_value_bits!r}")
        if not 0 <= self.secure_dropout < 0.5:
            raise ValueError(f"secure_dropout must be in [0, 0.5), got {self.secure_dropout}")
        if not (math.isfinite(self.secure_fit_factor) and 1.0 <= self.secure_fit_factor <= 10.0):
            raise ValueError(f"secure_fit_factor must be in [1, 10], got {self.secure_fit_factor}")
        if not (math.isfinite(self.secure_keep) and 0.01 <= self.secure_keep <= 1.0):
            raise ValueError(f"secure_keep must be in [0.01, 1], got {self.secure_keep}")
        if self.enabled and self.mode == "local" and self.clipping == "adaptive":
            raise ValueError("clipping = \"adaptive\" needs mode = \"central\": the clip-bit count is noised by the "
                             "coordinator")

    def resolve(self, population: int, contributions: int) -> PrivacySettings:
        """These settings for a population of ``population`` devices of which a round asks ``contributions``
        (the defaults filled in); ValueError naming what cannot hold."""
        n = self.population or population
        if self.population is not None and self.population < population:
            raise ValueError(f"population {self.population} is smaller than the {population} devices that "
                             f"can be selected")
        m = self.expected_contributions or contributions
        if not 1 <= m <= n:
            raise ValueError(f"expected_contributions must be in [1, population = {n}], got {m}")
        delta = default_delta(n) if self.delta is None else self.delta
        if not 0 < delta < 1.0 / n:
            raise ValueError(f"delta must be in (0, 1/N) = (0, {1.0 / n:.3g}) for a population of N = {n}, "
                             f"got {delta:g}: at delta >= 1/N a mechanism that publishes one device's data "
                             f"whole satisfies the guarantee")
        out = replace(self, population=n, expected_contributions=m, delta=delta,
                      server_lr=auto_server_lr(self.noise_multiplier, self.clip, m) if self.server_lr == "auto"
                      else self.server_lr)
        if out.clipping == "adaptive" and out.noise_multiplier > 0 and out.noise_multiplier >= out.bit_stddev:
            raise ValueError(f"adaptive clipping: noise_multiplier {out.noise_multiplier:g} must be below "
                             f"count_stddev = {out.bit_stddev:g} (one device moves the clip-bit count by 1, so "
                             f"z_Delta = (z^-2 - sigma_b^-2)^(-1/2)); raise count_stddev, or leave it unset "
                             f"(default max(m / 20, 2 z))")
        return out

    @property
    def banded(self) -> bool:
        """Banded correlated noise (flayer.engine.correlated) rather than a fresh draw each round."""
        return self.noise_kind == "banded" and self.noise_bands > 1

    def correlated_problem(self) -> str | None:
        """Why banded noise cannot run with these settings (None: it can, or the noise is independent)."""
        if not self.banded:
            return None
        if self.secure_aggregation or self.mode != "central":
            return ("noise_kind = \"banded\" needs mode = \"central\" without secure aggregation: its state (the last "
                    "noise vectors) must stay with the one party that adds the noise, and local or distributed shares "
                    "have no such party")
        if self.clipping == "adaptive":
            return ("noise_kind = \"banded\" needs clipping = \"fixed\": the stream's noise std z C must not change "
                    "between rounds, and adaptive clipping moves C")
        if self.max_participations is None or self.min_separation < self.noise_bands:
            return (f"noise_kind = \"banded\" with noise_bands = {self.noise_bands} needs a participation schema: "
                    f"max_participations set and min_separation >= {self.noise_bands} (got "
                    f"{self.max_participations}, {self.min_separation}); closer rounds of one device share the "
                    f"strategy's rows, and its epsilon would not be the k-fold composition the accountant books")
        return None

    @property
    def schema(self) -> ParticipationSchema:
        return ParticipationSchema(self.max_participations, self.min_separation)

    @property
    def clip_range(self) -> float:
        """R of the secure ring: the configured range, else C with DP (a clipped upload's coordinates lie in
        [-C, C]), else 8 (as Flower's SecAgg+ default)."""
        if self.secure_clip_range is not None:
            return self.secure_clip_range
        return self.clip if self.enabled else 8.0

    @property
    def bit_stddev(self) -> float:
        """sigma_b: the noise on the clip-bit count. Default ``max(m / 20, 2 z)``: Andrew et al.'s m / 20, raised
        to 2 z where z is larger -- one device moves the count by 1, so sigma_b must exceed z, and at 2 z the
        update noise is ``z / sqrt(3/4)``, 15.5% above z (flayer.engine.privacy, rule 5)."""
        m = self.expected_contributions or 1
        return self.count_stddev if self.count_stddev is not None else max(m / 20.0, 2.0 * self.noise_multiplier)

    def warnings(self, epsilon: float, rounds: int) -> list[str]:
        """What a plan should say before it runs (resolved settings; ``epsilon``: what ``rounds`` rounds spend
        against readers of the models): a population too small, or an epsilon too large, to protect much."""
        assert self.population is not None and self.expected_contributions is not None
        out = []
        if self.population < 100:
            out.append(f"population N = {self.population}: with fewer than 100 devices differential privacy "
                       f"protects little; a round sums at most m C = {self.expected_contributions} C of signal, and "
                       f"the noise that gives a useful epsilon has std z C with z above 1 (here "
                       f"{self.noise_multiplier:g}), so it either drowns what the round learns or the epsilon is large")
        if epsilon > 10:
            out.append(f"epsilon {epsilon:.3g} after {rounds} rounds: above 10 the guarantee bounds little (an "
                       f"adversary's odds about one device may move by e^{epsilon:.3g}); raise z, run fewer "
                       f"rounds, or accept that these rounds are not private in any useful sense")
        return out
