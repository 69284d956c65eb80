"""Whether a set of devices could unmask a round's sum, from what the server has seen (the coordinator's outlook).

Unmasking rebuilds, for each device of the sum (a survivor u), its self-mask seed b_u, and for each device that
shared and is not in the sum (dropped, or named faulty and refused), its mask key s_u; each from t shares that
survivors reveal. A survivor can reveal its share of u only when u sealed it one (u's neighbours that advertised)
and it opened (no complaint of that pair: a complaint proves the share was no share, or names the complainer);
u's own share of b_u counts for u itself. A device named faulty answers nothing.

:func:`shortfall` is a necessary condition, not a sufficient one: the consent and unmask stages may still lose
devices. The coordinator uses it twice (:mod:`coordinator.secure_round`): a round whose every possible survivor set
falls short ends at once, and the masked inputs' stage is not closed at quorum and grace on a set that falls short
while a device whose masked input would complete it can still come.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .params import SecAggParams

__all__ = ["shortfall"]


def shortfall(params: SecAggParams, members: Collection[str], sealed_for: Mapping[str, Collection[str]],
              spoiled: Collection[tuple[str, str]], faulty: Collection[str]) -> str | None:
    """Why ``members`` (the devices whose masked inputs would be summed) could not unmask the sum (None: the shares
    they hold suffice, as far as the server knows). ``sealed_for``: each device that shared -> the devices it sealed a
    share for; ``spoiled``: the (complainer, accused) pairs of checked complaints; ``faulty``: the named devices."""
    t, bad, inside = params.threshold, set(faulty), set(members)
    answering = inside - bad
    for owner in sorted(sealed_for):
        kind = "b" if owner in inside else "s"
        holders = set(sealed_for[owner]) | ({owner} if kind == "b" else set())
        holders -= {c for c, a in spoiled if a == owner}
        n = len(holders & answering)
        if n < t:
            return (f"{n} of the {len(answering)} devices that would answer hold a share of {kind}_{owner}, "
                    f"fewer than t={t}")
    return None
