"""Certificates ride in the key adverts, never on a retained topic (docs/explanation/security.md, "Device keys are
certified, not copied"; docs/explanation/secure-aggregation.md, "Signed key adverts").

The adversaries, each with only its own view, against a real Mosquitto (its own port, stopped by PID) and devices
started from their kits (:mod:`certfed`):

- a hostile device (its own kit) that withholds its certificate -- it sends its advert without one, or with another
  device's -- so that its neighbours could check none of its keys. The guarantee: the coordinator's real check
  (:class:`coordinator.device_certs.DeviceCerts`, :class:`coordinator.secure_round.SecureRound`) names it and leaves
  it out, and the round unmasks the others' sum;
- a thief with a re-keyed device's old kit (the MQTT password stays): it puts the old, revoked certificate where
  devices used to read certificates. The guarantee: a restarted peer still believes the advert carrying the new
  certificate, and an advert carrying the old one is refused -- by the coordinator, which names the sender, and by
  the peer;
- the read-only observer and any device publishing on ``cert/``: nothing reaches a device;
- whoever counts on devices downloading every certificate at connect: no device subscribes to ``cert/`` at all.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from certfed import FED, VICTIM, T, kit_federation, own_keys, secure_terms
from fedtestlib import Recorder

from coordinator.device_certs import DeviceCerts
from coordinator.device_keys import DeviceKeys
from coordinator.secure_round import SecureRound
from edge_client.certified_keys import round_keys
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.peer_keys import peer_keys_for
from flayer.engine.secure import secure_from_plan
from flayer.secagg import DeviceConsistency, SecAggClient, decode_message
from mqtt_broker import load_credentials, mosquitto_available
from protocol import Envelope, Kind, decode_envelope
from protocol.signing import advert_signer, advert_verifier, survivor_signer, survivor_verifier

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
COHORT = ("dev-a", VICTIM, "dev-c", "dev-d", "dev-e")
HOSTILE = "dev-c"


@pytest.fixture(scope="module")
def shard(digits):  # type: ignore[no-untyped-def]
    from flayer.partition import make_partition
    from flayer.train import client_data

    return client_data(digits, make_partition(digits.y, digits.num_classes, 2, "iid", 0).clients[0])


def _client(fed: Any, device: str, params: Any, round_: int) -> SecAggClient:
    """``device`` as its own kit makes it take part (edge_client.certified_keys.round_keys, as edge_client.secure)."""
    creds = fed.creds(device)
    keys, own, admit = round_keys(peer_keys_for(creds, fed.tmp / f"state-{device}"))
    signer = creds.signer()
    return SecAggClient(params, device, consistency=DeviceConsistency(
        survivor_signer(signer, FED, round_, device), survivor_verifier(keys, FED, round_), 0.0,
        advert_signer(signer, FED, round_, device), advert_verifier(keys, FED, round_), own, admit))


def _coordinator_round(fed: Any, round_: int, threshold: int) -> SecureRound:
    """The coordinator's secure round as coordinator.secure_phase opens it: its certificate check over the broker
    folder it reads (the authority's PUBLIC key and signed revocation list)."""
    planned = secure_from_plan({**secure_terms(round_, len(COHORT)), "threshold": threshold}, round_, COHORT)
    assert planned is not None
    certs = DeviceCerts(FED, fed.state).for_round()
    assert certs is not None, "the broker folder holds an authority: certificates are required"
    return SecureRound(planned, None, time.time() + 60, verify=survivor_verifier(certs, FED, round_),  # type: ignore[arg-type]
                       verify_advert=advert_verifier(certs, FED, round_), certs=certs)


def _send_over_broker(fed: Any, device: str, creds: Any, body: bytes, round_: int) -> tuple[str, bytes]:
    """``device`` (with ``creds``) publishes ``body`` on its secagg/ topic; what the coordinator's connection
    receives there, the sender proven by the envelope's signature under the broker's key registry."""
    assert fed.coord is not None
    env = Envelope(Kind.SECAGG, FED, device, round_, 0, 1, len(body), hashlib.sha256(body).hexdigest(), body)
    rec = Recorder(creds)
    try:
        assert rec.link.wait_published([rec.link.publish(T.secagg(device), env.encode(creds.signer()))], 5)
    finally:
        rec.close()
    got = fed.coord.wait_message(lambda m: m.topic == T.secagg(device), 10)
    assert got is not None, f"the coordinator received nothing from {device}"
    env = decode_envelope(got.payload, trust=DeviceKeys(FED, fed.state / "signing_keys.json"))
    return env.sender, env.body


@pytest.mark.parametrize("carried", ["none", "another"])
@pytest.mark.timeout(180)
def test_a_device_withholding_its_certificate_is_named_and_the_others_are_unmasked(tmp_path: Path,
                                                                                    carried: str) -> None:
    fed = kit_federation(tmp_path, list(COHORT), together=True)
    fed.coord = Recorder(fed.fb.coordinator, [T.all_secagg()])
    try:
        rnd = _coordinator_round(fed, 1, threshold=3)
        params = rnd.planned.params
        clients = {d: _client(fed, d, params, 1) for d in COHORT if d != HOSTILE}
        for d, c in clients.items():
            assert rnd.receive(d, c.advertise().to_bytes()) is None, f"{d}'s honest advert was refused"
        # the hostile device: its own kit, its own key, no certificate of its own in its advert
        hostile = fed.creds(HOSTILE)
        cert = b"" if carried == "none" else fed.cert("dev-a")
        keys, _, _ = round_keys(peer_keys_for(hostile, tmp_path / "state-hostile"))
        bad = SecAggClient(params, HOSTILE, consistency=DeviceConsistency(
            survivor_signer(hostile.signer(), FED, 1, HOSTILE), survivor_verifier(keys, FED, 1), 0.0,
            advert_signer(hostile.signer(), FED, 1, HOSTILE), advert_verifier(keys, FED, 1), cert))
        sender, body = _send_over_broker(fed, HOSTILE, hostile, bad.advertise().to_bytes(), 1)
        assert rnd.receive(sender, body) is not None, "the coordinator accepted an advert its neighbours cannot check"
        why = rnd.server.faulty.get(HOSTILE, "")
        assert HOSTILE in rnd.server.faulty, "the device that withheld its certificate was not named"
        assert ("carries no certificate" if carried == "none" else "certificate of 'dev-a'") in why, why
        assert HOSTILE not in rnd.server.advertised

        server = rnd.server  # the round goes on without it: every honest device takes part, none refuses
        vectors = {d: np.arange(params.length, dtype=np.uint32) * (i + 1) for i, d in enumerate(clients)}
        for d, c in clients.items():
            server.receive_shares(c.share_keys(decode_message(server.key_bundle(d).to_bytes())))
        for d, c in clients.items():
            server.receive_masked(c.masked_input(decode_message(server.shares_for(d).to_bytes()), vectors[d]))
        for d, c in clients.items():
            server.receive_consent(c.consent(decode_message(server.consent_request(d).to_bytes())))
        for d, c in clients.items():
            server.receive_signature(c.sign_survivors(decode_message(server.consistency_request(d).to_bytes())))
        for d, c in clients.items():
            server.receive_unmask(c.unmask(decode_message(server.unmask_request(d).to_bytes())))
        total = sum(v.astype(np.uint64) for v in vectors.values()) % (1 << params.ring.bits)
        assert np.array_equal(np.asarray(server.result(), dtype=np.uint64), total), "the honest devices' sum is wrong"
    finally:
        fed.close()


@pytest.mark.timeout(240)
def test_an_old_kit_cannot_make_a_restarted_peer_distrust_the_new_key(tmp_path: Path, shard: Any,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    fed = kit_federation(tmp_path, list(COHORT), together=True)
    try:
        caplog.set_level(logging.WARNING)
        fed.start_victim(shard)
        thief = fed.creds("dev-d")  # the old kit, copied: its key, its certificate (serial 1), its MQTT password
        old_cert, old_key = fed.cert("dev-d"), thief.signer()
        assert fed.admin("rekey", "dev-d", "--kit", str(fed.tmp / "machine-dev-d" / "dev-d.tar.gz")) == 0
        fed.renew("dev-d")  # the real dev-d restarts from its new kit (serial 2)
        time.sleep(1.0)
        rec = Recorder(thief)  # the old password still connects; it puts the revoked certificate back
        try:
            for payload in (old_cert, b""):
                rec.link.wait_published([rec.link.publish(f"fl/{FED}/cert/dev-d", payload, retain=True)], 5)
                time.sleep(0.3)
        finally:
            rec.close()
        fed.restart_victim(shard)
        time.sleep(1.0)
        assert fed.victim_shares(2, COHORT, own_keys(fed, COHORT)), \
            "a restarted peer distrusts the re-keyed device's new certificate"
        assert not fed.victim_shares(3, COHORT, {**own_keys(fed, COHORT), "dev-d": old_key},
                                     certs={"dev-d": old_cert}), "a peer believed the old, revoked certificate"
        assert any("dev-d" in r.getMessage() and "revoked" in r.getMessage() and "refuses the round" in r.getMessage()
                   for r in caplog.records), "the peer did not say the old certificate is revoked"

        rnd = _coordinator_round(fed, 4, threshold=3)  # and the coordinator names the old kit's advert
        old = SecAggClient(rnd.planned.params, "dev-d", consistency=DeviceConsistency(  # what it checks: its affair
            survivor_signer(old_key, FED, 4, "dev-d"), lambda *_: True, 0.0,
            advert_signer(old_key, FED, 4, "dev-d"), lambda *_: True, old_cert))
        assert rnd.receive("dev-d", old.advertise().to_bytes()) is not None
        assert "revoked" in rnd.server.faulty.get("dev-d", ""), rnd.server.faulty
    finally:
        fed.close()


@pytest.mark.timeout(120)
def test_the_observer_and_devices_put_nothing_on_a_certificate_topic_that_a_device_receives(tmp_path: Path) -> None:
    fed = kit_federation(tmp_path, ["dev-a", "dev-c"])
    try:
        for creds, topic in ((load_credentials(fed.state, "observer"), f"fl/{FED}/cert/observer"),
                             (fed.creds("dev-c"), f"fl/{FED}/cert/dev-c")):
            rec = Recorder(creds)
            try:  # a retained message every device would download at each connect (1 MiB works as well)
                rec.link.wait_published([rec.link.publish(topic, b"x" * 4000, retain=True)], 5)
            finally:
                rec.close()
        time.sleep(0.5)
        reader = Recorder(fed.creds("dev-a"), [f"fl/{FED}/cert/#"])
        try:
            got = reader.wait_message(lambda m: True, 3)
            assert got is None, f"a device received {len(got.payload)} bytes on {got.topic}"
        finally:
            reader.close()
    finally:
        fed.close()


@pytest.mark.timeout(120)
def test_no_device_downloads_certificates_at_connect(tmp_path: Path, shard: Any) -> None:
    fed = kit_federation(tmp_path, ["dev-a", VICTIM])
    try:
        settings = EdgeSettings(state_dir=str(fed.kits[VICTIM] / "state"), client_index=1, device="cpu",
                                heartbeat_s=2.0)
        victim = EdgeClient(settings, fed.creds(VICTIM), shard)
        asked: list[str] = []
        subscribe = victim.link.subscribe
        victim.link.subscribe = lambda filters: (asked.extend(filters), subscribe(filters))[1]  # type: ignore[method-assign]
        fed.victim = victim
        victim.start()
        deadline = time.time() + 20
        while T.revocations() not in asked and time.time() < deadline:
            time.sleep(0.1)
        assert T.revocations() in asked, f"the device never subscribed to the revocation list: {asked}"
        assert not [t for t in asked if "/cert/" in t], f"the device downloads certificates at connect: {asked}"
    finally:
        fed.close()
