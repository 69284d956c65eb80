"""A device whose signed key advert carries fewer per-pair channel keys than signatures
(docs/explanation/secure-aggregation.md, "Signed key adverts" and "Faults named and left out").

The adversary is one selected device of a secure round: it writes its own advert, signed with its own key, and may
shape it as it likes. Here: one signature per neighbour, as the coordinator asks, but a single per-pair key where
k - 1 are due. On the code before, the coordinator matched the signatures to the channel keys before it counted
the keys, ran off the end of the list and raised an IndexError out of its message handler: the coordinator's
event loop ended, and with it the federation, for one message of one device. Now the advert is refused and its
sender named faulty, as for any malformed pair keys; the round goes on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from coordinator.secure_round import SecureRound
from flayer.engine.secure import PlannedSecure, round_params
from flayer.engine.secure_layout import layout_of
from flayer.privacy_config import PrivacySettings
from flayer.secagg import KeyAdvert, LocalIdentities, SecAggClient, SeededEntropy
from flayer.update import TensorDelta, Update

IDS = tuple(f"dev-{i}" for i in range(6))


def test_an_advert_short_of_pair_keys_is_refused_and_its_sender_named():
    up = Update({"w": TensorDelta((8,), np.zeros(3, np.float32), np.array([1, 4, 6]))}, 10)
    lay = layout_of(up)
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, IDS, lay, 0)
    who = LocalIdentities(IDS, SeededEntropy(bytes(32)))
    sec = SecureRound(PlannedSecure(params, lay.digest, False, 5.0), lay, stage_end=105.0, verify=who.verify)
    evil = IDS[0]
    honest = SecAggClient(params, evil, consistency=who.for_device(evil)).advertise()
    assert len(honest.pair_pks) >= 2
    short = dataclasses.replace(honest, pair_pks=honest.pair_pks[:1])  # its own signature toward each neighbour
    why = sec.receive(evil, KeyAdvert.to_bytes(short))  # on the code before: IndexError out of the handler
    assert why is not None and "pair keys" in why
    assert evil in sec.server.faulty and evil not in sec.server.advertised
    for d in IDS[1:]:
        assert sec.receive(d, SecAggClient(params, d, consistency=who.for_device(d)).advertise().to_bytes()) is None
    assert sec.server.advertised == frozenset(IDS[1:])
