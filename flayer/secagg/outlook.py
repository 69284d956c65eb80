"""Whether a set of devices could unmask a round's sum, from what the server has seen (the coordinator's outlook).

Unmasking rebuilds, for each device of the sum (a survivor u), its self-mask seed b_u, and for each device that
shared and is not in the sum (dropped, or named faulty and refused), its mask key s_u; each from t shares that
survivors reveal. A survivor can reveal its share of u only when u sealed it one (u's neighbours that advertised)
and it opened (no complaint of that pair: a complaint proves the share was no share, or names the complainer);
u's own share of b_u counts for u itself. A device named faulty answers nothing. A device out of the sum whose every
answering neighbour complained of it (or may still: its masked input, which its complaints precede, not in yet)
needs no shares of s_u: each of them reveals its own pair's mask seed toward it instead.

:func:`shortfall` is a necessary condition, not a sufficient one: the consent and unmask stages may still lose
devices. The coordinator uses it twice (:mod:`coordinator.secure_round`): a round whose every possible survivor set
falls short ends at once, and the masked inputs' stage is not closed at quorum and grace on a set that falls short
while a device whose masked input would complete it can still come.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .params import SecAggParams

__all__ = ["Outlook", "shortfall"]


def shortfall(params: SecAggParams, members: Collection[str], sealed_for: Mapping[str, Collection[str]],
              spoiled: Collection[tuple[str, str]], faulty: Collection[str],
              pending: Collection[str] = ()) -> str | None:
    """Why ``members`` (the devices whose masked inputs would be summed) could not unmask the sum (None: the shares
    they hold suffice, as far as the server knows). ``sealed_for``: each device that shared -> the devices it sealed a
    share for; ``spoiled``: the (complainer, accused) pairs of checked complaints; ``faulty``: the named devices;
    ``pending``: members whose masked input (and so their complaints, sent before it) may still come.

    A device out of the sum whose every answering neighbour holds nothing of it (each complained of it) needs no
    t shares of s_u: each reveals its own pair's mask seed toward it instead (``SecAggServer.result``); a member
    still pending may yet complain."""
    t, bad, inside, later = params.threshold, set(faulty), set(members), set(pending)
    answering = inside - bad
    for owner in sorted(sealed_for):
        kind = "b" if owner in inside else "s"
        holders = set(sealed_for[owner]) | ({owner} if kind == "b" else set())
        complained = {c for c, a in spoiled if a == owner}
        holders -= complained
        n = len(holders & answering)
        if kind == "s" and set(sealed_for[owner]) & answering <= complained | later:
            continue  # by the pair seeds of its neighbours, once each complained
        if n < t:
            return (f"{n} of the {len(answering)} devices that would answer hold a share of {kind}_{owner}, "
                    f"fewer than t={t}")
    return None


class Outlook:
    """:func:`shortfall` for a server that asks it on every tick of its coordinator: who sealed shares for whom is
    read once the share batches are in, and an answer is kept while the members, the complaints and the named devices
    stay the same (a device moving from "can still come" into the sum leaves the members the coordinator asks about
    as they were). About 3 ms a computation at n = 1,000, k = 38."""

    def __init__(self, params: SecAggParams) -> None:
        self.params = params
        self._sealed_for: dict[str, frozenset[str]] = {}
        # the last answers by (members, complaints, named, pending): the coordinator asks of two sets on one tick (the
        # set in and the largest that can come: coordinator.secure_round), so a single answer would be recomputed
        self._answers: dict[tuple[frozenset[str], int, int, frozenset[str]], str | None] = {}

    def shortfall(self, members: Collection[str], sent: Mapping[str, Collection[Any]],
                  spoiled: Collection[tuple[str, str]], faulty: Collection[str],
                  pending: Collection[str] = (), named_out: bool = False) -> str | None:
        """:func:`shortfall` of ``members``; ``sent``: each device that shared -> its sealed shares (``.receiver``);
        ``named_out``: a device named faulty is no member (a round with a consent stage takes its input back out)."""
        if len(self._sealed_for) != len(sent):
            self._sealed_for = {d: frozenset(s.receiver for s in shares) for d, shares in sent.items()}
            self._answers.clear()
        key = (frozenset(members) - (frozenset(faulty) if named_out else frozenset()), len(spoiled), len(faulty),
               frozenset(pending))
        if key not in self._answers:
            if len(self._answers) >= 4:
                del self._answers[next(iter(self._answers))]  # the oldest
            self._answers[key] = shortfall(self.params, key[0], self._sealed_for, spoiled, faulty, key[3])
        return self._answers[key]
