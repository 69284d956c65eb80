"""The SecAgg+ neighbour graph and the rule that picks its degree k and the threshold t.

Bell et al. (CCS 2020, Sec. 3-4) replace SecAgg's complete graph by a random k-regular graph with
k = O(log n): a device masks with, and shares its secrets among, its k neighbours only, so its cost
is O(k + vector length) instead of O(n + vector length).

**Graph** (:func:`neighbour_graph`): a shuffled ring, as Flower's SecAgg+ builds it. The participants
are ordered by SHA-256(domain, public seed, id) (a uniformly random order any party recomputes from
the round's public seed, with no dependence on numpy's generator streams), and each is joined to the
k/2 devices on either side. The graph is symmetric and every device has degree exactly k (k even,
2 <= k <= n-2); k = n-1 is the complete graph of the original SecAgg.

**Degree and threshold** (:func:`neighbour_count`), per round, for n participants, a dropout
probability delta (a device fails, independently, somewhere between sharing its keys and answering
the unmask stage), a fraction gamma of devices that collude with the coordinator, and a failure
budget eta (default 2^-20 per round, union-bounded over the n devices):

* n <= ``complete_up_to`` (8), or ``complete=True``: the complete graph, k = n-1;
* otherwise the smallest even k in [2 ceil(log2 n), n-2] for which
  t = :func:`threshold_floor` = max(2, floor((k+1+c)/2) + 1), c the least count with
  n * P[Bin(k, gamma) > c] <= eta (the colluders among a device's neighbours), also meets n * P[Bin(k, 1-delta) < t] <= eta (a dropped device's k neighbours still hold t live
  shares of its key) and n * (delta + gamma)^(k/2) <= eta (the honest survivors' ring stays
  connected: cutting it takes k/2 consecutive devices of the order that dropped or collude),
  falling back to the complete graph when no k <= n-2 does.

t is thus always a strict majority of a device's k+1 share holders (its k neighbours and itself):
no two disjoint sets of honest devices can each hand over t shares, one set of b_u and the other of
s_u. Dropout is tolerated while every dropped device keeps t responsive neighbours and every
survivor t responsive holders; for delta = 0.1 this gives k = 34, 38, 42 for n = 100, 10^3, 10^4.

**Partial sums.** Masks cancel within each connected component of the graph among the (honest)
survivors, so if dropouts or colluders split it the coordinator could unmask each component's sum
(Bell et al., Sec. 4). The ring splits only where k/2 consecutive devices of the order are gone,
which the third condition above bounds; the coordinator also checks that the survivors' graph is
connected before it asks for any share and abandons the round otherwise
(:meth:`~flayer.secagg.server.SecAggServer.unmask_request`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence

from .errors import SecAggError

__all__ = ["check_degree", "colluders", "connected", "neighbour_count", "neighbour_graph", "round_failure",
           "threshold_floor"]

_DOMAIN = b"flayer-secagg/v1/graph\x00"
DEFAULT_FAILURE = 2.0**-20


def check_degree(n: int, k: int) -> None:
    """ValueError unless k = n-1 (complete) or k is even with 2 <= k <= n-2 (a shuffled ring)."""
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"degree k must be an integer, got {k!r}")
    if k == n - 1 and n >= 2:
        return
    if k % 2 or not 2 <= k <= n - 2:
        raise ValueError(f"degree k={k} for {n} participants must be n-1 (complete) or even in [2, n-2]")


def neighbour_graph(participants: Sequence[str], k: int, seed: bytes) -> dict[str, frozenset[str]]:
    """Each participant's k neighbours in the shuffled ring drawn from ``seed`` (symmetric)."""
    ids = list(participants)
    n = len(ids)
    if len(set(ids)) != n:
        raise SecAggError("participants must be distinct")
    check_degree(n, k)
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != 32:
        raise ValueError("graph seed must be 32 bytes")
    if k == n - 1:
        everyone = frozenset(ids)
        return {u: everyone - {u} for u in ids}
    order = sorted(ids, key=lambda u: (hashlib.sha256(_DOMAIN + bytes(seed) + u.encode()).digest(), u))
    half = k // 2
    return {u: frozenset(order[(i + j) % n] for j in range(-half, half + 1) if j)
            for i, u in enumerate(order)}


def connected(graph: Mapping[str, frozenset[str]], nodes: Collection[str]) -> bool:
    """True when the graph's edges among ``nodes`` join them all (an empty or one-node set is connected): masks
    cancel within each connected part of a survivor set, so a split one would expose each part's sum."""
    members = set(nodes)
    if not members:
        return True
    start = min(members)
    seen, todo = {start}, [start]
    while todo:
        for v in graph[todo.pop()] & members:
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return seen == members


def _tail_ge(k: int, p: float, t: int) -> float:
    """P[Bin(k, p) >= t]."""
    if t <= 0:
        return 1.0
    return min(1.0, sum(math.comb(k, i) * p**i * (1.0 - p) ** (k - i) for i in range(t, k + 1)))


def colluders(n: int, k: int, gamma: float, eta: float = DEFAULT_FAILURE) -> int:
    """c: the most of a device's k neighbours that collude, but for probability ``eta`` over the round's n
    devices (the least c with ``n * P[Bin(k, gamma) > c] <= eta``; 0 when gamma = 0)."""
    c = 0
    while c < k and n * _tail_ge(k, gamma, c + 1) > eta:
        c += 1
    return c


def threshold_floor(n: int, k: int, gamma: float, eta: float = DEFAULT_FAILURE) -> int:
    """The least threshold t a device accepts for n participants, k neighbours and a colluding fraction gamma:
    ``max(2, floor((k + 1 + c) / 2) + 1)`` with c = :func:`colluders`. A coordinator that tells a device's
    share holders different stories gets its b-shares from one set A of honest holders and its s-shares from a
    disjoint set B (an honest holder reveals one kind per device), and both kinds from the c colluders: it
    needs ``|A| + c >= t`` and ``|B| + c >= t`` with ``|A| + |B| + c <= k + 1``, impossible once
    ``2t > k + 1 + c``. With gamma = 0 the floor is a strict majority of the k+1 holders."""
    if not (isinstance(gamma, (int, float)) and 0 <= gamma < 1):
        raise ValueError(f"colluding fraction must be in [0, 1), got {gamma!r}")
    return max(2, (k + 1 + colluders(n, k, gamma, eta)) // 2 + 1)


def _threshold(n: int, k: int, gamma: float, eta: float) -> int:
    return threshold_floor(n, k, gamma, eta)  # >= c + 1: the colluders alone never hold t shares


def neighbour_count(n: int, dropout_rate: float, *, corrupt_fraction: float = 0.0,
                    failure_probability: float = DEFAULT_FAILURE, complete_up_to: int = 8,
                    complete: bool = False) -> tuple[int, int]:
    """``(k, t)`` for n participants by the rule of the module docstring."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"n must be an integer >= 2, got {n!r}")
    if not (isinstance(dropout_rate, (int, float)) and 0 <= dropout_rate < 1):
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    if not (isinstance(corrupt_fraction, (int, float)) and 0 <= corrupt_fraction < 1):
        raise ValueError(f"corrupt_fraction must be in [0, 1), got {corrupt_fraction!r}")
    if not (isinstance(failure_probability, (int, float)) and 0 < failure_probability < 1):
        raise ValueError(f"failure_probability must be in (0, 1), got {failure_probability!r}")
    if not complete and n > complete_up_to:
        for k in range(2 * math.ceil(math.log2(n)), n - 1, 2):
            t = _threshold(n, k, corrupt_fraction, failure_probability)
            # P[Bin(k, 1-delta) < t] = P[Bin(k, delta) >= k-t+1], summed directly (no 1 - x cancellation)
            if (t <= k and n * _tail_ge(k, dropout_rate, k - t + 1) <= failure_probability
                    and n * (dropout_rate + corrupt_fraction) ** (k // 2) <= failure_probability):
                return k, t
    k = n - 1
    return k, min(_threshold(n, k, corrupt_fraction, failure_probability), k + 1)


def round_failure(n: int, k: int, t: int, need: int, dropout_rate: float) -> float:
    """An upper bound on the chance that a round of n participants, k neighbours each and threshold t, cannot be
    unmasked when devices drop independently at ``dropout_rate`` (honest devices): fewer than ``need`` survive
    (max(t, T): the survivor set devices sign, and the signatures the unmasking needs), plus with a sparse graph
    the union bounds of :func:`neighbour_count`'s rule (a dropped device without t live holders, a split ring). The
    complete graph has only the first term: every device holds a share of every other."""
    p = 1.0 - dropout_rate
    total = min(1.0, sum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(0, min(need, n + 1))))
    if k < n - 1:
        total += n * _tail_ge(k, dropout_rate, k - t + 1) + n * dropout_rate ** (k // 2)
    return min(1.0, total)
