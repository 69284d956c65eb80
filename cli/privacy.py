"""The ``[privacy]`` flags of ``flayer simulate`` and ``flayer emulate``, and ``--dp-plan``: epsilon, the
noise for a target epsilon and the rounds it allows, from the accountant alone, in seconds, before a run
(docs/howto/privacy-budget.md)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from cli.errors import CliError

__all__ = ["add_privacy_flags", "plan_text", "privacy_overrides"]


def add_privacy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("differential privacy (flags override [privacy]; docs/explanation/privacy.md)")
    g.add_argument("--dp", choices=("central", "local"), default=None,
                   help="client-level DP: the coordinator (central) or each device (local) adds the Gaussian noise")
    g.add_argument("--dp-clip", type=float, metavar="C", help="L2 bound on a device's upload (0.3)")
    g.add_argument("--dp-noise", type=float, metavar="Z", help="noise multiplier: std z*C on the round's sum (1.0)")
    g.add_argument("--dp-delta", type=float, metavar="D",
                   help="delta of the reported epsilon (default min(1e-5, 1/(10 N)); must be below 1/N)")
    g.add_argument("--target-epsilon", type=float, metavar="EPS",
                   help="stop before a round would bring epsilon above EPS")
    g.add_argument("--dp-clipping", choices=("fixed", "adaptive"), default=None,
                   help="adaptive: C follows a private estimate of the update norms' quantile (Andrew et al. 2021)")
    g.add_argument("--dp-clip-split", choices=("total", "sqrt", "equal"), default=None,
                   help="C over the whole upload (total), or a bound C_i a layer with sum C_i^2 = C^2: C_i "
                        "proportional to sqrt(the layer's uploaded coordinates) (sqrt, the default) or equal (equal)")
    g.add_argument("--dp-server-lr", type=server_lr_arg, metavar="ETA",
                   help="server step on the noised average: next = prev + ETA * v (post-processing, no epsilon); "
                        "auto (the default): sqrt(0.03 / (z C / m)) within [1, 3], from the noise on the average")
    g.add_argument("--dp-server-momentum", type=float, metavar="BETA",
                   help="server step's momentum: v <- BETA * v + (sum + noise) / m, in [0, 1) (0.0)")
    g.add_argument("--secure-agg", action="store_true", default=None,
                   help="secure aggregation (SecAgg+): the coordinator learns only each round's sum "
                        "(docs/explanation/secure-aggregation.md)")
    g.add_argument("--secure-dropout", type=float, metavar="P",
                   help="secure rounds: the dropout rate the threshold is chosen to survive (0.1); flayer simulate "
                        "also drops each selected device at a random protocol step with probability P")
    g.add_argument("--secure-keep", type=float, metavar="FRACTION",
                   help="secure rounds: the most of the round's common positions a masked input keeps, a subset drawn "
                        "from the run seed (1.0; the coordinator fits it to the devices' uplinks below this)")
    g.add_argument("--max-participations", type=int, metavar="K",
                   help="participation schema: each device selected in at most K rounds; epsilon is then K-fold "
                        "composition, not R-fold (docs/explanation/privacy.md)")
    g.add_argument("--min-separation", type=int, metavar="B",
                   help="participation schema: a device selected again only B rounds after its last (0)")
    g.add_argument("--dp-noise-kind", choices=("independent", "banded"), default=None,
                   help="central noise: a fresh draw each round (independent), or banded correlated noise (DP-MF) "
                        "whose prefix sums carry less; banded needs --max-participations and --min-separation >= "
                        "--dp-bands (docs/explanation/privacy.md)")
    g.add_argument("--dp-bands", type=int, metavar="B", help="banded noise: the strategy's bands (1 to 64)")
    g.add_argument("--dp-plan", action="store_true",
                   help="print epsilon against each adversary for these settings, and z / rounds for "
                        "--target-epsilon, then exit")


def server_lr_arg(text: str) -> float | str:
    """``--dp-server-lr``: a number, or the text as given ("auto"; anything else is refused, naming server_lr, with
    the rest of [privacy])."""
    try:
        return float(text)
    except ValueError:
        return text


def privacy_overrides(a: dict[str, Any]) -> dict[str, Any]:
    """The ``[privacy]`` keys the flags set (None: not given)."""
    return {"enabled": True if a.get("dp") else None, "mode": a.get("dp"), "clip": a.get("dp_clip"),
            "noise_multiplier": a.get("dp_noise"), "delta": a.get("dp_delta"),
            "target_epsilon": a.get("target_epsilon"), "clipping": a.get("dp_clipping"),
            "clip_split": a.get("dp_clip_split"),
            "server_lr": a.get("dp_server_lr"), "server_momentum": a.get("dp_server_momentum"),
            "secure_aggregation": a.get("secure_agg"), "secure_dropout": a.get("secure_dropout"),
            "secure_keep": a.get("secure_keep"), "max_participations": a.get("max_participations"),
            "min_separation": a.get("min_separation"), "noise_kind": a.get("dp_noise_kind"),
            "noise_bands": a.get("dp_bands")}


def epsilon_text(eps: Any, spec: str = ".4g") -> str:
    """Epsilon as printed: a number (formatted by ``spec``), or "infinite" (a record's "inf", or no noise)."""
    if isinstance(eps, str):
        return "infinite" if eps == "inf" else eps
    return "infinite" if math.isinf(eps) else format(eps, spec)


def schema_text(most: Any, separation: Any = 0) -> str:
    """The schema a printed epsilon assumes (:meth:`flayer.privacy_config.ParticipationSchema.describe`; values no
    schema takes read as every round, as :meth:`~flayer.privacy_config.ParticipationSchema.of_record` reads them)."""
    from flayer.privacy_config import ParticipationSchema

    return ParticipationSchema.of_record({"dp_max_participations": most, "dp_min_separation": separation}).describe()


def epsilon_lines(rec: dict[str, Any], rounds: int) -> str:
    """The lines a private run's end prints from its last round record (or summary): epsilon against each
    adversary, named (docs/explanation/privacy.md, "Who learns what"), and the schema it assumes."""
    coord = rec.get("epsilon_coordinator")
    raw = rec.get("privacy")
    cfg: dict[str, Any] = raw if isinstance(raw, dict) else {}
    schema = schema_text(rec.get("dp_max_participations", cfg.get("max_participations")),
                         rec.get("dp_min_separation", cfg.get("min_separation", 0)))
    released = rec.get("dp_rounds")  # the rounds composed: a secure round abandoned before its sum was revealed is not
    counted = (f"{rounds} rounds" if not isinstance(released, int) or released == rounds else
               f"{released} rounds whose sum was revealed ({rounds} closed, {rounds - released} abandoned before it)")
    out = (f"privacy: epsilon {epsilon_text(rec['epsilon'])} at delta {rec['delta']:.3g} after {counted} for {schema}, "
           f"against readers of the published models, devices and broker observers (the cohort is public: no "
           f"amplification)")
    if coord is not None:
        out += (f"\nprivacy: epsilon {epsilon_text(coord)} against the coordinator"
                + (" (it sees the updates, or their sum, before the noise: no guarantee)" if epsilon_text(coord) == "infinite"
                   else ""))
    return out


def plan_text(settings: Any, population: int, asked: int, rounds: int, contributions: int | None = None) -> str:
    """What ``--dp-plan`` prints: epsilon after ``rounds`` rounds against each adversary, warnings when the
    guarantee says little, for a target epsilon the z it needs and the rounds z allows, and -- labelled as
    not offered -- what a secret cohort would give; ``contributions``: the fixed denominator m when it is
    not ``asked`` (the coordinator's quorum). CliError on bad settings."""
    from flayer.engine.accountant import epsilon_fixed_size, epsilon_for, noise_for_target, rounds_for_target

    try:
        s = settings.resolve(population, contributions or asked)
    except ValueError as exc:
        raise CliError(f"[privacy]: {exc}") from None
    z, d, m, k = s.noise_multiplier, s.delta, s.expected_contributions, s.max_participations
    eps = epsilon_for([(z, 1.0, rounds)], d, k)
    who = s.schema.describe()
    if s.mode == "central":
        coord = "infinite (it sees " + ("their un-noised sum" if s.secure_aggregation else "every clipped update") + \
            " before it adds the noise)"
    elif s.secure_aggregation:
        coord = f"{epsilon_text(eps)} (secure aggregation: it sees only the sum, which carries the devices' shares)"
    else:
        coord = (f"{epsilon_text(epsilon_for([(z / math.sqrt(m), 1.0, rounds)], d, k))} (it sees each upload with its "
                 f"device's share alone, multiplier z / sqrt(m) = {z / math.sqrt(m):.3g})")
    lines = [(f"population N = {population}, {asked} asked per round, fixed denominator m = {m}, C = {s.clip:g}, "
              f"z = {z:g}, {s.mode} noise, delta = {d:.3g}"),
             "the cohort is public (plans list it): every round counts in full (q = 1) for every adversary",
             (f"epsilon {epsilon_text(eps)} after {rounds} rounds for {who}, against readers of the published models, "
              f"devices and broker observers (exact Gaussian composition)"),
             f"epsilon against the coordinator, for {who}: {coord}"]
    if k is not None:
        lines.append(f"participation schema: the selection names a device in at most {k} cohorts"
                     + (f", {s.min_separation} rounds apart at least" if s.min_separation > 1 else "")
                     + f"; a round fills from the devices it allows (fewer when fewer are eligible); without it, a "
                       f"device in every round: {epsilon_text(epsilon_for([(z, 1.0, rounds)], d))}")
    if s.clipping == "adaptive" and z > 0:
        from flayer.engine.privacy import adaptive_update_multiplier

        lines.append(f"adaptive clipping: clip-bit count noise sigma_b = {s.bit_stddev:g} (one device moves the count by "
                     f"1: a zero upload reports bit 1), update noise z_Delta = "
                     f"{adaptive_update_multiplier(z, s.bit_stddev):.4g}: together one Gaussian mechanism of "
                     f"multiplier z = {z:g}")
    if s.mode == "local" and not s.secure_aggregation:
        lines.append(f"local noise: a round that closes with k < m uploads carries z sqrt(k / m) and is composed so "
                     f"(set min_updates = {m} to keep z)")
    if math.isfinite(eps):
        lines += [f"warning: {w}" for w in s.warnings(eps, rounds)]
    if s.target_epsilon is not None:
        zt = noise_for_target(s.target_epsilon, d, 1.0, rounds, k)
        allowed = rounds_for_target(s.target_epsilon, d, 1.0, z)
        lines.append(f"target epsilon {s.target_epsilon:g} for {who}: {rounds} rounds need z >= {zt:.3f}; z = {z:g} "
                     + (f"allows {allowed} rounds" if k is None else
                        f"allows {allowed} participations a device" + (" (any number of rounds)" if allowed >= k
                                                                        else f", fewer than {k}")))
    if asked < population and z > 0:
        q = asked / population
        lines.append(f"not offered by this release, for comparison only: were the cohort secret from an adversary, "
                     f"Poisson sampling at q = {q:.3g} would give {epsilon_text(epsilon_for([(z, q, rounds)], d))} against it "
                     f"(PLD), a secret fixed-size cohort {epsilon_text(epsilon_fixed_size(population, asked, z, rounds, d))} "
                     f"(RDP, replace-one neighbours)")
    return "\n".join(lines)
