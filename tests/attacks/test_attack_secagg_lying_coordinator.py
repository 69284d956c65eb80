"""A coordinator that lies to the devices of a secure round (docs/explanation/secure-aggregation.md, "What the
coordinator can and cannot learn").

The adversary is the coordinator: it writes the plan and every message a device reads on ``secreq/<id>``, and
may have one device colluding with it. Its aim is both secrets of one honest device u (the share of b_u and
the share of u's mask key from enough holders), which unmask u's input alone. Its moves, each with only what a
coordinator holds:

* a plan with a threshold t = 2 (any two holders then suffice), or a majority t that ignores the colluders
  the devices assume -- the device computes the floor itself and refuses;
* a plan whose graph seed is its own choice (so that it picks who neighbours whom) -- refused: the device
  recomputes the seed from the run seed and the round;
* an unmask request telling u "only you survived" with a survivor count it makes up, so u hands over the
  mask-key shares of all its neighbours -- refused: u counts the survivors listed, not the count stated.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from flayer.engine.secure import round_ring, secure_from_plan
from flayer.secagg import RingSpec, SecAggClient, SecAggError, SecAggParams, SecAggServer, UnmaskRequest

IDS = tuple(f"dev-{i:02d}" for i in range(6))
RUN_SEED = 7


def _plan(threshold: int, degree: int = 5, graph_seed: bytes | None = None) -> dict[str, object]:
    """A plan's ``secure`` mapping as the coordinator writes it (every key a device reads)."""
    seed = hashlib.sha256(f"secagg-graph:{RUN_SEED}:1".encode()).digest() if graph_seed is None else graph_seed
    return {"session": "fed.1.ab", "threshold": threshold, "degree": degree, "graph_seed": seed.hex(), "length": 8,
            "bits": round_ring(1.0, len(IDS), 16).bits, "value_bits": 16, "layout": "ab" * 32,
            "adaptive": False, "stage_s": 10.0, "noise_std": 0.0, "bound": 1.0, "value_range": 1.0,
            "corrupt_fraction": 0.0, "run_seed": RUN_SEED, "dropout": 0.1}


def test_a_plan_with_t_2_is_refused_by_the_devices():
    assert secure_from_plan(_plan(4), 1, IDS) is not None  # the majority of 6 holders: the honest plan
    with pytest.raises(ValueError, match="below the floor"):
        secure_from_plan(_plan(2), 1, IDS)


def test_a_majority_t_that_ignores_the_colluders_a_device_assumes_is_refused():
    """One colluder among u's holders plus two disjoint honest groups, one shown u as a survivor and one as
    dropped, reach a majority t of both kinds; a device assuming colluders (gamma) asks for more."""
    with pytest.raises(ValueError, match="below the floor"):
        secure_from_plan(_plan(4), 1, IDS, min_corrupt_fraction=0.05)
    assert secure_from_plan(_plan(6), 1, IDS, min_corrupt_fraction=0.05) is not None


def test_a_graph_seed_of_the_coordinators_choosing_is_refused():
    with pytest.raises(ValueError, match="graph seed"):
        secure_from_plan(_plan(4, graph_seed=bytes(32)), 1, IDS)


def test_only_you_survived_gets_no_mask_key_shares():
    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    server, clients = SecAggServer(params), {d: SecAggClient(params, d) for d in IDS}
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    for d in IDS:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    for d in IDS:
        server.receive_masked(clients[d].masked_input(server.shares_for(d), np.zeros(8, np.uint32)))
    u = IDS[0]
    lie = UnmaskRequest(1, u, len(IDS), (u,), IDS[1:])  # "you alone survived; the others dropped"
    with pytest.raises(SecAggError, match="fewer than t"):
        answer = clients[u].unmask(lie)
        pytest.fail(f"{u} revealed the mask-key shares of {[o for o, _ in answer.s_shares]}")
