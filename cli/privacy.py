"""The ``[privacy]`` flags of ``flayer simulate`` and ``flayer emulate``, and ``--dp-plan``: epsilon, the
noise for a target epsilon and the rounds it allows, from the accountant alone, in seconds, before a run
(docs/howto/privacy-budget.md)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from cli.common import CliError

__all__ = ["add_privacy_flags", "plan_text", "privacy_overrides"]


def add_privacy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("differential privacy (flags override [privacy]; docs/explanation/privacy.md)")
    g.add_argument("--dp", choices=("central", "local"), default=None,
                   help="client-level DP: the coordinator (central) or each device (local) adds the Gaussian noise")
    g.add_argument("--dp-clip", type=float, metavar="C", help="L2 bound on a device's upload (1.0)")
    g.add_argument("--dp-noise", type=float, metavar="Z", help="noise multiplier: std z*C on the round's sum (1.0)")
    g.add_argument("--dp-delta", type=float, metavar="D", help="delta of the reported epsilon (default 1/N^1.1)")
    g.add_argument("--target-epsilon", type=float, metavar="EPS",
                   help="stop before a round would bring epsilon above EPS")
    g.add_argument("--dp-clipping", choices=("fixed", "adaptive"), default=None,
                   help="adaptive: C follows a private estimate of the update norms' quantile (Andrew et al. 2021)")
    g.add_argument("--secure-agg", action="store_true", default=None,
                   help="secure aggregation (SecAgg+): the coordinator learns only each round's sum "
                        "(docs/explanation/secure-aggregation.md)")
    g.add_argument("--secure-dropout", type=float, metavar="P",
                   help="secure rounds: the dropout rate the threshold is chosen to survive (0.1); flayer simulate "
                        "also drops each selected device at a random protocol step with probability P")
    g.add_argument("--dp-plan", action="store_true",
                   help="print epsilon for these settings, and z / rounds for --target-epsilon, then exit")


def privacy_overrides(a: dict[str, Any]) -> dict[str, Any]:
    """The ``[privacy]`` keys the flags set (None: not given)."""
    return {"enabled": True if a.get("dp") else None, "mode": a.get("dp"), "clip": a.get("dp_clip"),
            "noise_multiplier": a.get("dp_noise"), "delta": a.get("dp_delta"),
            "target_epsilon": a.get("target_epsilon"), "clipping": a.get("dp_clipping"),
            "secure_aggregation": a.get("secure_agg"), "secure_dropout": a.get("secure_dropout")}


def plan_text(settings: Any, population: int, asked: int, rounds: int, contributions: int | None = None) -> str:
    """What ``--dp-plan`` prints: the sampling rate, epsilon after ``rounds`` rounds at z, and for a target
    epsilon the z it needs over ``rounds`` and the rounds z allows; ``contributions``: the fixed denominator m
    when it is not ``asked`` (the coordinator's quorum). CliError on bad settings."""
    from flayer.engine.accountant import epsilon_for, noise_for_target, rounds_for_target

    try:
        s = settings.resolve(population, contributions or asked)
    except ValueError as exc:
        raise CliError(f"[privacy]: {exc}") from None
    q = s.sample_rate(asked)
    z, d = s.noise_multiplier, s.delta
    eps = epsilon_for([(z, q, rounds)], d)
    spent = (f"C = {s.clip:g}, z = {z:g}, {s.mode} noise, fixed denominator m = {s.expected_contributions}: "
             f"epsilon after {rounds} rounds = {eps:.3f}") if math.isfinite(eps) else \
        f"z = {z:g}: no noise, epsilon is infinite"
    head = (f"population N = {population}, {asked} asked per round: q = {q:.4g} (fixed-size selection accounted "
            f"as Poisson at q, docs/explanation/privacy.md); delta = {d:.3g}")
    lines = [head, spent]
    if s.target_epsilon is not None:
        zt = noise_for_target(s.target_epsilon, d, q, rounds)
        lines.append(f"target epsilon {s.target_epsilon:g}: {rounds} rounds need z >= {zt:.3f}; "
                     f"z = {z:g} allows {rounds_for_target(s.target_epsilon, d, q, z)} rounds")
    return "\n".join(lines)
