"""Who trains: every selection policy of the stack, as pure seeded functions.

- :func:`select_clients` -- the in-process simulator's (PFLlib's): ``round(join_ratio x N)`` of all N
  clients, at least one, uniformly, seeded per round;
- :func:`select_devices` -- a synchronous MQTT round's over-selection among the devices online:
  ``k = min(online, ceil(over_selection x quorum))``, seeded from (run seed, round), so a restarted
  coordinator draws the same devices;
- :func:`assign_slots` -- asynchronous rounds: free training slots (``concurrency``) filled from the
  idle devices online, seeded from (run seed, model version, how many slots were given before).

All three draw with :func:`draw`: ``k`` of a sorted pool without replacement.

With a participation schema (``[privacy] max_participations`` k, ``min_separation`` b;
:class:`flayer.privacy_config.ParticipationSchema`) the pool is first cut by :func:`eligible`: a device named
in k earlier cohorts, or in one fewer than b rounds before, is not in it. The rule reads only the earlier plans'
``selected`` lists (:func:`participations`) and the secure rounds a later plan names abandoned before any consent was
asked (``secure.void``: :func:`void_rounds`), so anyone holding the plans can check every cohort against it. A
selection in such a void round revealed nothing of the device (no sum was unmasked, and the device books a round only
at its consent, :mod:`edge_client.booking`): it does not count toward k, only toward the separation b.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from flayer.privacy_config import ParticipationSchema
from flayer.strategies.base import derive_seed

__all__ = ["assign_slots", "cohort_size", "draw", "eligible", "participations", "select_clients", "select_devices", "void_rounds"]

T = TypeVar("T")


def draw(pool: Sequence[T], k: int, *key: int | str) -> list[T]:
    """``k`` members of ``pool`` (already sorted, distinct), uniformly without replacement, from a
    generator seeded by ``key``; the whole pool when ``k >= len(pool)``. Sorted."""
    if k >= len(pool):
        return list(pool)
    rng = np.random.default_rng(derive_seed(*key))  # public: the cohort is drawn from the plans' seed by design
    return sorted(pool[int(i)] for i in rng.choice(len(pool), size=k, replace=False))  # type: ignore[type-var]


def participations(cohorts: Iterable[tuple[int, Iterable[T]]]) -> dict[T, list[int]]:
    """``{device: the rounds it was selected in, ascending}`` from ``(round, selected)`` of the plans."""
    out: dict[T, list[int]] = {}
    for r, selected in sorted(cohorts, key=lambda c: c[0]):
        for d in selected:
            if r not in out.setdefault(d, []):
                out[d].append(r)
    return out


def void_rounds(plans: Iterable[tuple[int, str | None, str | None]]) -> frozenset[int]:
    """The rounds whose secure session a plan names abandoned before its unmasking, from ``(round, its secure
    session or None, its secure.void)`` of each plan (``secure.void``: sessions, space-separated)."""
    rounds: dict[str, int] = {}
    named: set[str] = set()
    for r, session, void in plans:
        if session:
            rounds[session] = r
        named.update((void or "").split())
    return frozenset(r for session, r in rounds.items() if session in named)


def eligible(pool: Sequence[T], history: Mapping[T, Sequence[int]], schema: ParticipationSchema,
             round_: int, void: Collection[int] = frozenset()) -> list[T]:
    """The members of ``pool`` the schema lets take part in ``round_`` given ``history`` (:func:`participations`
    of the earlier plans), in ``pool``'s order. A round in ``void`` (:func:`void_rounds`) counts toward the
    separation, never toward max_participations."""
    out = []
    for d in pool:
        taken = tuple(history.get(d, ()))
        counted = sum(1 for r in taken if r not in void)
        if schema.refuses_count(counted, taken[-1] if taken else None, round_) is None:
            out.append(d)
    return out


def select_clients(num_clients: int, join_ratio: float, seed: int, round_: int,
                   schema: ParticipationSchema | None = None,
                   history: Mapping[int, Sequence[int]] | None = None) -> list[int]:
    """PFLlib's selection: round(join_ratio * N) clients (at least 1), uniformly, seeded per round; with a
    ``schema``, drawn from the clients it allows (fewer when fewer are eligible, none when none is)."""
    k = max(1, int(round(join_ratio * num_clients)))
    pool = list(range(num_clients))
    if schema is not None and schema.active:
        pool = eligible(pool, history or {}, schema, round_)
    return draw(pool, k, seed, round_, "select")


def cohort_size(online: int, quorum: int, over_selection: float) -> int:
    """How many of ``online`` devices a round selects: ``min(online, ceil(over_selection x quorum))``, at least the
    quorum (module docstring)."""
    return min(online, max(quorum, math.ceil(over_selection * quorum - 1e-9)))


def select_devices(online: Sequence[str], quorum: int, over_selection: float, seed: int, round_: int) -> list[str]:
    """Seeded over-selection among ``online`` (module docstring); sorted ids."""
    pool = sorted(set(online))
    return draw(pool, cohort_size(len(pool), quorum, over_selection), seed, round_, "mqtt-select")


def assign_slots(idle: Sequence[str], free: int, seed: int, version: int, given: int) -> list[str]:
    """Asynchronous rounds: ``free`` of the ``idle`` devices (online, holding no slot) get a slot;
    ``given`` (slots handed out so far in this version) keeps successive draws apart. Sorted ids."""
    if free <= 0:
        return []
    return draw(sorted(set(idle)), free, seed, version, given, "async-slot")
