"""A coordinator that makes honest devices complain, to open the shares the complaints' keys unlock
(docs/explanation/secure-aggregation.md, "Faults named and left out", sealed shares that do not open).

The adversary is the coordinator alone (no colluding device): it routes every sealed share, so it can alter the
ciphertexts a victim W sealed for its neighbours before it delivers them. A neighbour whose share from W does not
open complained (on the code before), revealing its private channel key of the pair (v, W) -- the key that opens the
ciphertext W really sealed for v, which the coordinator kept. With a complaint from t of W's neighbours it holds t
shares of both of W's secrets, the self-mask seed b_W and the mask key s_W, and removes every mask from W's masked
input: W's input alone, the very thing the protocol exists to hide (the consistency round's "never both kinds of
one device's shares" is bypassed: the complaint gives both).

Now a share that does not authenticate proves nothing about its sender -- whoever routes it can alter it -- so the
device reveals no key for it: it masks with W as with a complainee and holds nothing of W (a neighbour fewer holds
W's shares), and only a share that opens under the pair's key yet is no share at its x (something only W, holding
that key, can have sealed) is complained of with the key.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from flayer.secagg import (
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ServerConsistency,
    keys,
    shamir,
)
from flayer.secagg.client import SHARE_STAGE
from flayer.secagg.prg import expand

IDS = tuple(f"dev-{i:02d}" for i in range(8))
W = IDS[3]  # the victim
WHO = LocalIdentities(IDS, SeededEntropy(b"long-term keys" + bytes(18)))


def _flip(ciphertext: bytes) -> bytes:
    return ciphertext[:20] + bytes([ciphertext[20] ^ 1]) + ciphertext[21:]


def _round():
    p = SecAggParams("fed.1.ab", 1, IDS, 3, 4, bytes(32), 16, RingSpec.for_summands(1.0, len(IDS)))
    server = SecAggServer(p, ServerConsistency(WHO.verify))
    clients = {d: SecAggClient(p, d, SeededEntropy(hashlib.sha256(d.encode()).digest()), WHO.for_device(d))
               for d in IDS}
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    sent = {}
    for d in IDS:
        sent[d] = clients[d].share_keys(server.key_bundle(d))
        server.receive_shares(sent[d])
    rng = np.random.default_rng(0)
    vectors = {d: rng.integers(0, p.ring.modulus, p.length, dtype=np.uint32) for d in IDS}
    return p, server, clients, sent, vectors


def test_a_coordinator_that_alters_a_victims_sealed_shares_learns_nothing_from_the_complaints():
    p, server, clients, sent, vectors = _round()
    near = sorted(p.neighbours(W))
    masked, leaked = {}, {}
    for d in IDS:
        batch = server.shares_for(d)
        if d in near:  # the coordinator alters what W sealed for d
            batch = dataclasses.replace(batch, shares=tuple(
                dataclasses.replace(s, ciphertext=_flip(s.ciphertext)) if s.sender == W else s for s in batch.shares))
        masked[d] = clients[d].masked_input(batch, vectors[d])
        for c in clients[d].complaints():
            if c.accused == W:
                leaked[d] = c.key  # the private channel key of the pair (d, W)
    # the coordinator opens, with each leaked key, the ciphertext W really sealed for that neighbour
    b_shares, s_shares = {}, {}
    for v, key in leaked.items():
        share = next(s for s in sent[W].shares if s.receiver == v)
        channel = keys.derive_aead_key(keys.agree(key, server._pair_key(W, v)), p.session, p.round, v, W)
        plain = keys.open_sealed(channel, share.ciphertext, keys.associated_data(p.session, p.round, W, v,
                                                                                   SHARE_STAGE, p.transcript), "W's share")
        x, y = shamir.decode_share(plain[:shamir.SHARE_LEN])
        b_shares[x] = y
        s_shares[x] = shamir.decode_share(plain[shamir.SHARE_LEN:])[1]
    if len(b_shares) >= p.threshold:  # both of W's secrets: W's input unmasked on its own
        b_w, s_w = shamir.combine(b_shares, p.threshold), shamir.combine(s_shares, p.threshold)
        x = masked[W].vector.copy() - expand(b_w, p.length)
        for v in sorted(clients[W].partners):
            seed = keys.derive_mask_seed(keys.agree(s_w, server._adverts[v].s_pk), p.session, p.round, W, v)
            x = x - expand(seed, p.length) if p.index(v) > p.index(W) else x + expand(seed, p.length)
        x &= np.uint32(p.ring.modulus - 1)
        assert not np.array_equal(x, vectors[W]), "the coordinator unmasked W's input alone from the complaints"
    assert leaked == {}, f"neighbours revealed their channel keys toward W for shares the coordinator altered: {leaked}"


def test_the_round_still_unmasks_without_the_altered_shares():
    p, server, clients, sent, vectors = _round()
    near = sorted(p.neighbours(W))
    victim = near[0]  # the coordinator (or W) spoils one share: the round goes on, nobody named, nothing revealed
    for d in IDS:
        batch = server.shares_for(d)
        if d == victim:
            batch = dataclasses.replace(batch, shares=tuple(
                dataclasses.replace(s, ciphertext=_flip(s.ciphertext)) if s.sender == W else s for s in batch.shares))
        server.receive_masked(clients[d].masked_input(batch, vectors[d]))
        assert clients[d].complaints() == ()
    for d in IDS:
        server.receive_consent(clients[d].consent(server.consent_request(d)))
    for d in sorted(server.survivors):
        server.receive_signature(clients[d].sign_survivors(server.consistency_request(d)))
    for d in sorted(server.survivors):
        server.receive_unmask(clients[d].unmask(server.unmask_request(d)))
    total = server.result()
    want = sum((vectors[d].astype(np.uint64) for d in IDS), np.zeros(p.length, np.uint64))
    assert np.array_equal(total.astype(np.uint64) % p.ring.modulus, want % p.ring.modulus)
    assert server.faulty == {}
