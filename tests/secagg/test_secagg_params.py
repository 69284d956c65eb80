"""The round's public parameters (params.py) and the input checks of the small building blocks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flayer.secagg import RingSpec, SecAggParams, SeededEntropy, encode, neighbour_graph
from flayer.secagg import keys as K
from flayer.secagg.prg import randbelow_from
from flayer.secagg.shamir import PRIME, encode_share

IDS = ("dev-b", "dev-a", "dev-c", "dev-d", "dev-e")
BASE = SecAggParams("fed", 1, IDS, 3, 4, bytes(32), 10, RingSpec.for_summands(1.0, 5))


def test_participants_are_sorted_and_indexed():
    assert BASE.participants == tuple(sorted(IDS))
    assert BASE.x_of("dev-a") == 1 and BASE.index("dev-e") == 4
    assert BASE.neighbours("dev-a") == set(IDS) - {"dev-a"}
    assert not BASE.is_participant("dev-z")


@pytest.mark.parametrize(("change", "reason"), [
    ({"session": "has space"}, "session id"),
    ({"round": -1}, "round"),
    ({"round": 2**32}, "round"),
    ({"participants": ("dev-a", "dev-a", "dev-b")}, "distinct"),
    ({"participants": ("dev-a",), "degree": 0}, "participants must number"),
    ({"participants": ("dev/a", "dev-b", "dev-c")}, "participant"),
    ({"degree": 3}, "degree"),
    ({"threshold": 1}, "threshold"),  # t = 1: any single share is the secret
    ({"threshold": 6}, "threshold"),  # t > k + 1: no secret can ever be rebuilt
    ({"graph_seed": bytes(31)}, "graph_seed"),
    ({"length": 0}, "length"),
    ({"length": 2**26 + 1}, "length"),
    ({"ring": RingSpec.for_summands(1.0, 4)}, "could wrap"),  # 5 summands in a ring sized for 4
])
def test_bad_parameters_are_refused(change, reason):
    with pytest.raises(ValueError, match=reason):
        replace(BASE, **change)


def test_the_ring_must_be_a_ring_spec():
    with pytest.raises(TypeError, match="RingSpec"):
        replace(BASE, ring=1.0)


def test_for_round_takes_k_and_t_from_the_rule():
    p = SecAggParams.for_round("fed", 1, [f"d{i:03d}" for i in range(100)], 10, RingSpec.for_summands(1.0, 100),
                               bytes(32), 0.1)
    assert (p.degree, p.threshold) == (34, 18)
    assert all(len(near) == 34 for near in p.graph.values())


def test_block_inputs_are_checked():
    entropy = SeededEntropy(bytes(32))
    with pytest.raises(ValueError, match="real numbers"):
        encode(np.array(["a"]), BASE.ring, None)
    with pytest.raises(ValueError, match="representable"):
        RingSpec(1e-320, max_summands=1)
    with pytest.raises(ValueError, match="y"):
        encode_share(1, PRIME)
    with pytest.raises(ValueError, match="entropy returned 3 bytes"):
        K.generate_keypair(lambda n: b"abc")
    with pytest.raises(ValueError, match="entropy returned 3 bytes"):
        K.seal(bytes(32), b"x", b"", lambda n: b"abc")
    with pytest.raises(ValueError, match="stage"):
        K.associated_data("fed", 1, "a", "b", 256, bytes(32))
    with pytest.raises(ValueError, match="round"):
        K.derive_mask_seed(bytes(32), "fed", 2**32, "a", "b")
    with pytest.raises(ValueError, match="seed"):
        SeededEntropy(bytes(5))
    with pytest.raises(ValueError, match="n must"):
        entropy(-1)
    with pytest.raises(ValueError, match="bound"):
        randbelow_from(entropy)(0)
    with pytest.raises(ValueError, match="graph seed"):
        neighbour_graph(["a", "b", "c"], 2, bytes(3))
    with pytest.raises(ValueError, match="distinct"):
        neighbour_graph(["a", "a", "c"], 2, bytes(32))
