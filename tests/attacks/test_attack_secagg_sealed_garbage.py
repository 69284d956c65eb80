"""A device that seals its neighbours shares that do not authenticate (docs/explanation/secure-aggregation.md,
"Faults named and left out").

The adversary is one selected device: it holds its own long-term key and its round keys, and sends what it likes in
its own envelope. It seals every neighbour 164 random bytes instead of its shares -- signed, since a batch its
sender did not sign is refused and its sender named on arrival. On the code before, a share that did not
authenticate was held as nothing and never complained of (it proved nothing: the router could have altered it), so
the device's neighbours held nothing of it, its secrets could not be rebuilt, and every round it was selected in was
lost with nobody named. Now the sender signs each sealed share (:mod:`flayer.secagg.signed_shares`): a share that
carries its sender's signature and does not authenticate can only be the sender's own, so its receivers complain
with the pair's channel key, the coordinator opens the ciphertext it routed, and the sender is named (left out of
later rounds). A coordinator altering an honest sender's signed share still gets no complaint: the signature no
longer verifies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from flayer.secagg import (
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ServerConsistency,
)
from flayer.secagg.signed_shares import sign_share

IDS = tuple(f"dev-{i:02d}" for i in range(8))
BAD = IDS[2]
WHO = LocalIdentities(IDS, SeededEntropy(b"long-term keys" + bytes(18)))


def _round():  # type: ignore[no-untyped-def]
    p = SecAggParams("fed.1.ab", 1, IDS, 3, 4, bytes(32), 16, RingSpec.for_summands(1.0, len(IDS)))
    server = SecAggServer(p, ServerConsistency(WHO.verify))
    clients = {d: SecAggClient(p, d, SeededEntropy(hashlib.sha256(d.encode()).digest()), WHO.for_device(d))
               for d in IDS}
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    return p, server, clients


def test_a_device_sealing_shares_that_do_not_authenticate_is_named() -> None:
    p, server, clients = _round()
    for d in IDS:
        batch = clients[d].share_keys(server.key_bundle(d))
        if d == BAD:  # random bytes for every neighbour, signed with its own key over its own pair keys
            bundle = server.key_bundle(d)
            garbage = []
            for s in batch.shares:
                mine = server._pair_key(d, s.receiver)
                theirs = next(a.c_pk for a in bundle.adverts if a.device == s.receiver)
                junk = dataclasses.replace(s, ciphertext=os.urandom(len(s.ciphertext)), signature=b"")
                garbage.append(sign_share(p, junk, mine, theirs, WHO.signer(d)))
            batch = dataclasses.replace(batch, shares=tuple(garbage))
        server.receive_shares(batch)
    rng = np.random.default_rng(0)
    named = set()
    for d in IDS:
        if d == BAD:
            continue
        clients[d].masked_input(server.shares_for(d), rng.integers(0, p.ring.modulus, p.length, dtype=np.uint32))
        for c in clients[d].complaints():
            named.add(server.receive_complaint(c))
    assert BAD in server.faulty, f"{BAD} sealed its neighbours shares that do not open and was not named"
    assert named == {BAD} and set(server.faulty) == {BAD}  # no honest complainer named
    assert "does not open" in server.faulty[BAD]


def test_an_honest_senders_share_altered_by_the_coordinator_gets_no_complaint() -> None:
    p, server, clients = _round()
    for d in IDS:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    victim = sorted(p.neighbours(IDS[5]))[0]
    batch = server.shares_for(victim)
    flipped = tuple(dataclasses.replace(s, ciphertext=bytes([s.ciphertext[0] ^ 1]) + s.ciphertext[1:])
                    if s.sender == IDS[5] else s for s in batch.shares)
    clients[victim].masked_input(dataclasses.replace(batch, shares=flipped), np.zeros(p.length, np.uint32))
    assert clients[victim].complaints() == ()  # the signature no longer verifies: proves nothing, reveals no key
