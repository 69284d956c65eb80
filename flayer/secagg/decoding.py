"""Which shares of one secret to trust: the unique-decoding test and the subsets to try (:class:`~.server.SecAggServer`)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping

from . import shamir

__all__ = ["decoded", "subsets"]


def decoded(shares: Mapping[int, int], used: Mapping[int, int], t: int, exact: bool) -> list[int] | None:
    """The x of the shares off the polynomial through ``used`` (t of ``shares``), or None when more than
    ``(m - t) / 2`` of the m shares are off it: that polynomial is then not determined by the shares (another one,
    the dealer's, may be off by as few), so nobody can be named from it. ``exact``: the polynomial's value at 0 is
    known to be the dealer's (b_u, by its commitment; not s_u, whose public key X25519's clamping leaves the same for
    other values), one more point: ``(m - t + 1) / 2``."""
    limit = (len(shares) - t + int(exact)) // 2
    beyond = sorted(set(shares) - set(used))
    on = shamir.evaluate_many(used, beyond)
    off = [x for x in beyond if on[x] != shares[x]]
    return off if len(off) <= limit else None


def subsets(xs: list[int], t: int, tries: int = 256) -> Iterator[tuple[int, ...]]:
    """t-subsets of the share positions ``xs`` to try, most likely clean first: the t smallest, each window of t
    consecutive ones (with one false share among m > t, some window leaves it out), then ``tries`` random ones
    (a fixed generator: nothing here is secret)."""
    if len(xs) < t:
        return
    yield tuple(xs[:t])
    m = len(xs)
    for i in range(1, m if m > t else 0):
        yield tuple(sorted(xs[(i + j) % m] for j in range(t)))
    pick = random.Random(m * 65537 + t)  # protects nothing: which subsets a connectivity check tries
    for _ in range(tries if m > t else 0):
        yield tuple(sorted(pick.sample(xs, t)))
