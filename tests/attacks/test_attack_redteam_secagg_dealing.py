"""A hostile device that deals shares of another self-mask seed than the one it committed to
(docs/explanation/secure-aggregation.md, "Faults named and left out").

The adversary is one participant. It runs the protocol with its own client, but the commitment in its key advert
is to a seed other than the b it Shamir-shares (here: random bytes in place of the commitment). Its neighbours
cannot tell -- a sealed share says nothing of the seed -- so it survives to the unmasking, and no t shares of its b
rebuild the committed seed: the round cannot be unmasked. The guarantee: that round is abandoned (``shares``)
and the dealer is named in it, so that it is left out of later rounds; no honest device is named.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from flayer.engine.secure import abandon_kind
from flayer.secagg import RingSpec, SecAggAbandoned, SecAggClient, SecAggParams, SecAggServer

IDS = tuple(f"dev-{i}" for i in range(6))
HOSTILE = "dev-2"


def test_a_device_dealing_shares_of_another_seed_than_it_committed_to_is_named():
    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    server, clients = SecAggServer(params), {d: SecAggClient(params, d) for d in IDS}
    for d in IDS:
        advert = clients[d].advertise()
        if d == HOSTILE:
            advert = replace(advert, b_commit=os.urandom(32))  # commits to no seed it shares
        server.receive_advert(advert)
    for d in IDS:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    for d in IDS:
        server.receive_masked(clients[d].masked_input(server.shares_for(d), np.ones(8, np.uint32)))
    for d in IDS:
        server.receive_unmask(clients[d].unmask(server.unmask_request(d)))
    with pytest.raises(SecAggAbandoned) as lost:
        server.result()
    assert abandon_kind(lost.value.reason) == "shares"
    assert set(server.faulty) == {HOSTILE}, f"named: {server.faulty}"
    assert "dealt shares" in server.faulty[HOSTILE]
