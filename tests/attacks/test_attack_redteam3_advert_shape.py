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


def test_a_signed_advert_with_one_channel_key_for_every_neighbour_is_refused_and_named():
    """The same device, its advert signed correctly but with one channel key toward every neighbour (no per-pair keys,
    the shape of a release before complaints). On the code before it was taken, and a complaint of a share it sealed
    at another x could not be checked ("one of them has no per-pair channel keys"): it sealed its neighbours garbage
    every round, unnamed. Every release that signs its adverts sends per-pair keys, so it is refused and named."""
    from flayer.secagg import SecAggError, SecAggServer, ServerConsistency

    up = Update({"w": TensorDelta((8,), np.zeros(3, np.float32), np.array([1, 4, 6]))}, 10)
    params, _ = round_params(PrivacySettings(secure_aggregation=True), "fed.1.x", 1, IDS, layout_of(up), 0)
    who = LocalIdentities(IDS, SeededEntropy(bytes(32)))
    server = SecAggServer(params, ServerConsistency(who.verify))
    evil = IDS[0]
    honest = SecAggClient(params, evil, consistency=who.for_device(evil)).advertise()
    from flayer.secagg.signed_adverts import sign_advert

    single = sign_advert(params, dataclasses.replace(honest, pair_pks=(), signatures=()), who.signer(evil))
    try:
        server.receive_advert(single)
    except SecAggError as exc:
        assert "pair keys" in str(exc)
    else:
        raise AssertionError("an advert without per-pair keys was taken: complaints of its sender cannot be checked")
    assert evil in server.faulty and evil not in server.advertised
