"""Witness signatures and pair seeds (flayer.secagg): a participant left out of the survivor set signs it too and
counts towards T; a dropped device whose shares never opened has its pairwise masks removed with each survivor's
own pair seed toward it, so the round is unmasked without it."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import pytest

from flayer.secagg import (
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ServerConsistency,
    decode_sum,
)
from flayer.secagg.ring import encode
from flayer.secagg.signed_shares import sign_share

IDS = tuple(f"dev-{i:02d}" for i in range(6))
WHO = LocalIdentities(IDS, SeededEntropy(b"witness keys" + bytes(20)))


def _setup(bad: str | None = None):  # type: ignore[no-untyped-def]
    p = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 16, RingSpec.for_summands(1.0, len(IDS)))
    server = SecAggServer(p, ServerConsistency(WHO.verify))
    clients = {d: SecAggClient(p, d, SeededEntropy(hashlib.sha256(d.encode()).digest()), WHO.for_device(d))
               for d in IDS}
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    for d in IDS:
        batch = clients[d].share_keys(server.key_bundle(d))
        if d == bad:  # random bytes for every neighbour, signed by their sender
            bundle = server.key_bundle(d)
            junk = []
            for s in batch.shares:
                theirs = next(a.c_pk for a in bundle.adverts if a.device == s.receiver)
                raw = dataclasses.replace(s, ciphertext=os.urandom(len(s.ciphertext)), signature=b"")
                junk.append(sign_share(p, raw, server._pair_key(d, s.receiver), theirs, WHO.signer(d)))
            batch = dataclasses.replace(batch, shares=tuple(junk))
        server.receive_shares(batch)
    return p, server, clients


def _consent(server: SecAggServer, clients, devices) -> None:  # type: ignore[no-untyped-def]
    for d in devices:  # the consent stage: each device whose masked input arrived
        server.receive_consent(clients[d].consent(server.consent_request(d)))


def _floats(p: SecAggParams, d: str) -> np.ndarray:
    return np.random.default_rng(int(d[-2:])).uniform(-0.5, 0.5, p.length)


def test_a_late_device_signs_as_a_witness_and_sends_no_masked_input() -> None:
    p, server, clients = _setup()
    late = IDS[-1]
    for d in IDS[:-1]:
        vector = encode(_floats(p, d), p.ring, np.random.default_rng(0))
        server.receive_masked(clients[d].masked_input(server.shares_for(d), vector))
    routed = server.shares_for(late)  # its training was slow: the shares are here, its masked input is not
    _consent(server, clients, IDS[:-1])
    with pytest.raises(SecAggError, match="sent no masked input: it is asked for no consent"):
        server.consent_request(late)
    for d in IDS:  # every participant is shown S and signs it, the late one too
        server.receive_signature(clients[d].sign_survivors(server.consistency_request(d)))
    assert server.witnesses == {late} and clients[late].left_out
    with pytest.raises(SecAggError, match="signed a survivor set that leaves it out"):
        clients[late].masked_input(routed, encode(_floats(p, late), p.ring, np.random.default_rng(0)))
    for d in IDS[:-1]:
        server.receive_unmask(clients[d].unmask(server.unmask_request(d)))
    total = decode_sum(server.result(), p.ring, len(IDS) - 1)
    assert np.abs(total - sum(_floats(p, d) for d in IDS[:-1])).max() < len(IDS) / p.ring.scale


def test_a_garbage_sealer_is_named_and_the_round_unmasks_without_it() -> None:
    bad = IDS[2]
    p, server, clients = _setup(bad)
    honest = [d for d in IDS if d != bad]
    for d in honest:
        vector = encode(_floats(p, d), p.ring, np.random.default_rng(0))
        masked = clients[d].masked_input(server.shares_for(d), vector)
        for c in clients[d].complaints():
            server.receive_complaint(c)
        server.receive_masked(masked)
    assert set(server.faulty) == {bad}
    _consent(server, clients, honest)
    for d in IDS:
        if d != bad:
            server.receive_signature(clients[d].sign_survivors(server.consistency_request(d)))
    answers = {d: clients[d].unmask(server.unmask_request(d)) for d in honest}
    assert all(dict(a.pair_seeds).keys() == {bad} for d, a in answers.items() if bad in p.neighbours(d))
    for a in answers.values():
        server.receive_unmask(a)
    total = decode_sum(server.result(), p.ring, len(honest))
    assert np.abs(total - sum(_floats(p, d) for d in honest)).max() < len(IDS) / p.ring.scale
