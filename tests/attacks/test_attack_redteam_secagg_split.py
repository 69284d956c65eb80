"""A coordinator that splits the survivors' neighbour graph to unmask partial sums
(docs/explanation/secure-aggregation.md, "The consistency round").

The neighbour graph is a shuffled ring: each device is joined to the k/2 devices on either side in an order that
anyone computes from the round's public graph seed. Pairwise masks cancel within each connected part of the
survivors' graph, so the sum of each part can be unmasked on its own -- the honest coordinator checks that the
survivors' graph is connected and abandons the round otherwise. The adversary is a coordinator that lies, with
no colluding device: it runs the round honestly up to the masked inputs (every device sent one), then calls two
blocks of k/2 consecutive devices of the order "dropped", which cuts the ring into two arcs. Every survivor still
sees t survivors among its neighbours, the survivor set S is the same for all of them and holds more than T of
the cohort, so each signs it; each reveals b-shares of its neighbours in S and mask-key shares of its neighbours
called dropped -- and the coordinator unmasks one arc's sum, a sum of fewer devices than S, that it chose.

The guarantee: a device refuses to sign (or to unmask with) a survivor set whose neighbour graph is split, so
the coordinator learns no partial sum.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from flayer.secagg import (
    ConsistencyRequest,
    RingSpec,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    UnmaskRequest,
    expand,
    keys,
    shamir,
)
from flayer.secagg.consistency import LocalIdentities, ServerConsistency
from flayer.secagg.graph import neighbour_count
from flayer.secagg.prg import SeededEntropy

N, LENGTH = 70, 4


def _components(nodes: set[str], params: SecAggParams) -> list[set[str]]:
    parts, left = [], set(nodes)
    while left:
        seen, todo = set(), [left.pop()]
        while todo:
            u = todo.pop()
            seen.add(u)
            todo += [v for v in params.neighbours(u) & left if v not in seen]
            left -= params.neighbours(u)
        parts.append(seen)
    return parts


@pytest.mark.slow
def test_a_coordinator_cannot_unmask_the_sum_of_one_arc_of_a_split_survivor_graph():
    ids = tuple(f"d{i:02d}" for i in range(N))
    k, t = neighbour_count(N, 0.1)  # the honest rule: (32, 17)
    params = SecAggParams("fed.1.ab", 1, ids, t, k, bytes(range(32)), LENGTH, RingSpec.for_summands(1.0, N))
    who = LocalIdentities(ids, SeededEntropy(bytes(32)))
    server = SecAggServer(params, ServerConsistency(who.verify))
    clients = {d: SecAggClient(params, d, consistency=who.for_device(d)) for d in ids}
    adverts = {d: clients[d].advertise() for d in ids}
    for d in ids:
        server.receive_advert(adverts[d])
    for d in ids:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    rng = np.random.default_rng(0)
    inputs = {d: rng.integers(0, 1000, LENGTH, dtype=np.uint32) for d in ids}
    masked = {d: clients[d].masked_input(server.shares_for(d), inputs[d]) for d in ids}

    # the adversary's move: the public order, and two blocks of k/2 consecutive devices called dropped
    seed = params.graph_seed  # the shuffled ring's order, as anyone computes it from the public seed
    order = sorted(ids, key=lambda u: (hashlib.sha256(b"flayer-secagg/v1/graph\x00" + seed + u.encode()).digest(), u))
    assert all(order[(i + 1) % N] in params.neighbours(u) for i, u in enumerate(order))
    half = k // 2
    arc = (N - 2 * half) // 2
    dropped = set(order[arc:arc + half]) | set(order[2 * arc + half:2 * arc + 2 * half])
    survivors = set(ids) - dropped
    parts = _components(survivors, params)
    assert len(parts) == 2, "the cut should split the survivors in two"
    part = min(parts, key=len)

    refused = 0
    signatures = []
    for d in sorted(survivors):
        try:
            signatures.append((d, clients[d].sign_survivors(ConsistencyRequest(1, d, tuple(sorted(survivors))))
                               .signature))
        except SecAggError:
            refused += 1
    answers = {}
    for d in sorted(survivors):
        near = params.neighbours(d)
        request = UnmaskRequest(1, d, len(survivors), tuple([d] + sorted(near & survivors)),
                                tuple(sorted(near & dropped)), tuple(signatures))
        try:
            answers[d] = clients[d].unmask(request)
        except SecAggError:
            refused += 1

    # what the adversary can rebuild: b of each device of the arc, the mask key of each dropped neighbour of it
    def rebuild(kind: str, owner: str) -> bytes | None:
        got = {}
        for answer in answers.values():
            for o, raw in (answer.b_shares if kind == "b" else answer.s_shares):
                if o == owner:
                    x, y = shamir.decode_share(raw)
                    got[x] = y
        return shamir.combine(got, t) if len(got) >= t else None

    total = np.zeros(LENGTH, np.uint32)
    for u in part:
        b = rebuild("b", u)
        if b is None:
            break
        total += masked[u].vector - expand(b, LENGTH)
        for v in params.neighbours(u) & dropped:
            s_v = rebuild("s", v)
            if s_v is None:
                break
            seed = keys.derive_mask_seed(keys.agree(s_v, adverts[u].s_pk), params.session, 1, u, v)
            total = total - expand(seed, LENGTH) if params.index(v) > params.index(u) else total + expand(seed, LENGTH)
    partial = np.sum(np.stack([inputs[u] for u in part]), axis=0, dtype=np.uint32)
    assert not np.array_equal(total, partial), \
        f"the coordinator unmasked the sum of {len(part)} of the {len(survivors)} survivors ({refused} refusals)"
    assert refused > 0
