"""A coordinator that swaps the keys it relays in a secure round (docs/explanation/secure-aggregation.md, "Signed key
adverts").

The adversary is the coordinator: it relays every device's key advert to the advert's neighbours in a key bundle,
and writes those bundles itself. Its aim: a device u seals its shares for a neighbour v (and masks with v) under
keys the coordinator holds instead of v's -- a man in the middle that reads every share u sends v, and with t of
them both secrets of u. Its moves, each with only what a coordinator holds (v's advert with v's signatures, the
adverts of earlier rounds and sessions, its own keys):

* put its own channel and mask keys in v's entry of u's bundle (keeping v's signature, or dropping it);
* replay v's entry from an earlier round, or from another session of the same round number (keys whose secrets it
  may have learnt: a dropped device's mask key is rebuilt at unmasking);
* move v's entry addressed to another neighbour w (v's key toward w, v's signature toward w) into u's bundle.

And a hostile device M that puts another device's id on its advert (its own keys, its own signature).

Each move must end with u refusing the round before it seals anything (no share sealed under a key the
coordinator holds), or with the forged advert refused and nobody framed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import pytest

from flayer.secagg import (
    DeviceConsistency,
    KeyBundle,
    LocalIdentities,
    RingSpec,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ServerConsistency,
    keys,
)

IDS = tuple(f"dev-{i:02d}" for i in range(6))
U, V, W, M = IDS[0], IDS[1], IDS[2], IDS[5]
WHO = LocalIdentities(IDS, SeededEntropy(b"long-term keys" + bytes(18)))  # the federation's registry


def _keys_stage(session: str = "fed.1.ab", round_id: int = 1, checking: bool = True):
    """Every device advertised to an honest-looking coordinator; its server and the devices' clients."""
    params = SecAggParams(session, round_id, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    server = SecAggServer(params, ServerConsistency(WHO.verify if checking else None))
    clients = {d: SecAggClient(params, d, SeededEntropy(hashlib.sha256(f"{session}/{d}".encode()).digest()),
                               WHO.for_device(d)) for d in IDS}
    for d in IDS:
        server.receive_advert(clients[d].advertise())
    return params, server, clients


def _swap(bundle: KeyBundle, device: str, entry) -> KeyBundle:
    return dataclasses.replace(bundle, adverts=tuple(entry if a.device == device else a for a in bundle.adverts))


@pytest.fixture
def seals(monkeypatch):
    """Every (AEAD key) a device seals a share under, as the coordinator would wish to see them."""
    used: list[bytes] = []
    real = keys.seal

    def spy(key, plain, ad, entropy):
        used.append(key)
        return real(key, plain, ad, entropy)

    monkeypatch.setattr(keys, "seal", spy)
    return used


def _refuses(client: SecAggClient, bundle: KeyBundle, seals: list[bytes]) -> None:
    with pytest.raises(SecAggError, match="refuses"):
        batch = client.share_keys(bundle)
        pytest.fail(f"{client.device} sealed {len(batch.shares)} shares under the keys the coordinator relayed")
    assert seals == []  # nothing sealed at all, let alone under the coordinator's key
    with pytest.raises(SecAggError, match="refused an earlier message"):
        client.share_keys(bundle)  # the round is over for this device


def test_an_honest_round_still_completes_with_signed_adverts():
    _, server, clients = _keys_stage()
    for d in IDS:
        server.receive_shares(clients[d].share_keys(server.key_bundle(d)))
    for d in IDS:
        server.receive_masked(clients[d].masked_input(server.shares_for(d), np.full(8, 3, np.uint32)))
    for d in IDS:
        server.receive_consent(clients[d].consent(server.consent_request(d)))
    for d in IDS:
        server.receive_signature(clients[d].sign_survivors(server.consistency_request(d)))
    for d in IDS:
        server.receive_unmask(clients[d].unmask(server.unmask_request(d)))
    assert list(server.result()) == [3 * len(IDS)] * 8


@pytest.mark.parametrize("keep_signature", [True, False])
def test_the_coordinators_own_keys_in_a_neighbours_entry_are_refused(seals, keep_signature):
    _, server, clients = _keys_stage()
    mine_c, mine_s = keys.generate_keypair(os.urandom), keys.generate_keypair(os.urandom)  # the coordinator's
    honest = server.key_bundle(U)
    v_entry = next(a for a in honest.adverts if a.device == V)
    forged = dataclasses.replace(v_entry, c_pk=mine_c.public, s_pk=mine_s.public)
    if not keep_signature and hasattr(forged, "signatures"):  # (before signed adverts: nothing to drop)
        forged = dataclasses.replace(forged, signatures=())
    _refuses(clients[U], _swap(honest, V, forged), seals)


def test_only_the_channel_key_swapped_is_refused(seals):
    _, server, clients = _keys_stage()
    honest = server.key_bundle(U)
    v_entry = next(a for a in honest.adverts if a.device == V)
    forged = dataclasses.replace(v_entry, c_pk=keys.generate_keypair(os.urandom).public)
    _refuses(clients[U], _swap(honest, V, forged), seals)


@pytest.mark.parametrize("earlier", [("fed.1.ab", 1), ("fed.1.zz", 1)], ids=["earlier-round", "other-session"])
def test_a_neighbours_entry_replayed_from_an_earlier_round_or_session_is_refused(seals, earlier):
    session, round_id = earlier
    _, old_server, _ = _keys_stage(session, round_id)
    old = next(a for a in old_server.key_bundle(U).adverts if a.device == V)  # v's genuine keys and signature, then
    _, server, clients = _keys_stage("fed.2.cd" if session == "fed.1.ab" else "fed.1.ab", 2 if round_id == 1 else 1)
    honest = server.key_bundle(U)
    replayed = dataclasses.replace(old, round=honest.round)
    assert replayed.c_pk != next(a for a in honest.adverts if a.device == V).c_pk
    _refuses(clients[U], _swap(honest, V, replayed), seals)


def test_a_neighbours_entry_for_another_receiver_is_refused(seals):
    _, server, clients = _keys_stage()
    moved = next(a for a in server.key_bundle(W).adverts if a.device == V)  # v's key toward w, signed for w
    honest = server.key_bundle(U)
    assert moved.c_pk != next(a for a in honest.adverts if a.device == V).c_pk
    _refuses(clients[U], _swap(honest, V, moved), seals)


def test_an_advert_under_another_devices_id_is_refused_and_frames_nobody():
    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))

    def posing() -> SecAggClient:  # M's own keys, signed with M's own key, under V's id
        return SecAggClient(params, V, SeededEntropy(b"M" * 32), DeviceConsistency(WHO.signer(M), WHO.verify))

    server = SecAggServer(params, ServerConsistency(WHO.verify))
    with pytest.raises(SecAggError, match="does not verify"):
        server.receive_advert(posing().advertise())
    assert V not in server.faulty and V not in server.advertised  # V is not blamed for what anyone could send
    server.receive_advert(_readvertise(params, V))
    assert V in server.advertised  # V's own advert still gets in
    # a coordinator that relays the posing advert unchecked: V's neighbours refuse the round
    lax = SecAggServer(params, ServerConsistency(None))
    lax.receive_advert(posing().advertise())
    victim = SecAggClient(params, U, SeededEntropy(b"U" * 32), WHO.for_device(U))
    lax.receive_advert(victim.advertise())
    for d in IDS[2:]:
        lax.receive_advert(_readvertise(params, d))
    with pytest.raises(SecAggError, match=f"not signed by {V}'s key"):
        victim.share_keys(lax.key_bundle(U))


def _readvertise(params: SecAggParams, device: str):
    return SecAggClient(params, device, SeededEntropy(hashlib.sha256(f"again/{device}".encode()).digest()),
                        WHO.for_device(device)).advertise()


def test_the_coordinator_names_a_device_whose_own_advert_is_signed_falsely():
    """Over the coordinator's round (coordinator.secure_round): the envelope proved who sent it, so a false signature
    is that device's own; a message under another device's id is refused and names nobody."""
    from coordinator.secure_round import SecureRound
    from flayer.engine.secure import PlannedSecure

    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    sec = SecureRound(PlannedSecure(params, "ab" * 32, False, 5.0), None, stage_end=10.0,  # type: ignore[arg-type]
                      verify=WHO.verify)
    false = SecAggClient(params, M, SeededEntropy(b"m" * 32), DeviceConsistency(WHO.signer(V), WHO.verify))
    assert "does not verify" in (sec.receive(M, false.advertise().to_bytes()) or "")
    assert M in sec.server.faulty and M not in sec.server.advertised
    assert "named faulty" in (sec.receive(M, _readvertise(params, M).to_bytes()) or "")
    posing = SecAggClient(params, V, SeededEntropy(b"p" * 32), DeviceConsistency(WHO.signer(W), WHO.verify))
    assert "naming 'dev-01', sent by 'dev-02'" in (sec.receive(W, posing.advertise().to_bytes()) or "")
    assert V not in sec.server.faulty and W not in sec.server.faulty
    assert sec.receive(V, _readvertise(params, V).to_bytes()) is None


def test_an_advert_signature_is_no_survivor_signature_nor_the_reverse():
    """On a real device the two purposes bind different contexts (protocol.signing): one cannot stand for the other."""
    from protocol.signing import (
        KeyRing,
        SigningKey,
        advert_signer,
        advert_verifier,
        survivor_signer,
        survivor_verifier,
    )

    key = SigningKey.generate()
    ring = KeyRing("fed", {"dev-00": key.public})
    data = b"the same bytes"
    assert advert_verifier(ring, "fed", 1)("dev-00", data, advert_signer(key, "fed", 1, "dev-00")(data))
    assert not survivor_verifier(ring, "fed", 1)("dev-00", data, advert_signer(key, "fed", 1, "dev-00")(data))
    assert not advert_verifier(ring, "fed", 1)("dev-00", data, survivor_signer(key, "fed", 1, "dev-00")(data))
    assert not advert_verifier(ring, "fed", 2)("dev-00", data, advert_signer(key, "fed", 1, "dev-00")(data))


def test_an_unsigned_or_short_signed_advert_is_refused_at_the_coordinator():
    """A hostile device that leaves its keys unsigned, or signs toward some neighbours only, would make those
    neighbours refuse the round; the coordinator refuses the advert instead (the device is out of the round)."""
    from coordinator.secure_round import SecureRound
    from flayer.engine.secure import PlannedSecure

    params = SecAggParams("fed.1.ab", 1, IDS, 4, 5, bytes(32), 8, RingSpec.for_summands(1.0, len(IDS)))
    sec = SecureRound(PlannedSecure(params, "ab" * 32, False, 5.0), None, stage_end=10.0,  # type: ignore[arg-type]
                      verify=WHO.verify)
    signed = _readvertise(params, M)
    assert "unsigned" in (sec.receive(M, dataclasses.replace(signed, signatures=()).to_bytes()) or "")
    assert M not in sec.server.advertised
    short = dataclasses.replace(signed, signatures=signed.signatures[:-1])
    assert "not one per neighbour" in (sec.receive(M, short.to_bytes()) or "")
    assert M in sec.server.faulty and M not in sec.server.advertised
