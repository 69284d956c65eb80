"""A secure-round message the coordinator signed for one device, moved to another device's topic
(docs/explanation/security.md, "Replays").

The coordinator signs every message it sends a device on ``secreq/<id>``; the envelope names the sender, the
federation and the round, not the device it was meant for (the message inside does). The adversary is
``mallory``, a device whose broker account was given a too-broad ACL (read and write on every topic of the
federation, as a mistaken ACL, a bridge or a broker defect would give it). It holds no key but its own: it
reads the key bundle the coordinator sent dev-a and publishes that very payload, signature intact, on
dev-b's ``secreq`` topic just before the coordinator's own bundle for dev-b arrives. On the old code dev-b
refused the copy and with it the rest of its round: its genuine bundle was then "out of order", it sent no
shares, and one replay took it out of the secure round. The guarantee: a message signed for another device
is ignored, and dev-b answers its own bundle with its shares.

The test plays the coordinator (and the four other selected devices' key adverts); dev-b is a real edge
client on a real Mosquitto.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import FedBroker, Recorder

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.peer_keys import PeerKeys
from flayer.engine.secure import round_ring, secure_from_plan
from flayer.secagg import DeviceConsistency, KeyAdvert, SecAggClient, SecAggServer, ShareBatch, decode_message
from mqtt_broker import mosquitto_available
from protocol import Envelope, Kind, Plan, Topics, decode_envelope, encode_message
from protocol.plan_digest import plan_digest
from protocol.signing import advert_signer, advert_verifier, survivor_signer, survivor_verifier

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)
IDS = ("dev-a", "dev-b", "dev-c", "dev-d", "dev-e", "dev-f")
RUN_SEED = 7


def _secure() -> dict[str, Any]:
    """A plan's ``secure`` mapping as the coordinator writes it: every selected device neighbours every other."""
    seed = hashlib.sha256(f"secagg-graph:{RUN_SEED}:1".encode()).digest()
    return {"session": f"{FED}.1.ab", "threshold": 6, "degree": 5, "graph_seed": seed.hex(), "length": 8,
            "bits": round_ring(1.0, len(IDS), 16).bits, "value_bits": 16, "layout": "ab" * 32,
            "adaptive": False, "stage_s": 10.0, "noise_std": 0.0, "bound": 1.0, "value_range": 1.0,
            "corrupt_fraction": 0.0, "run_seed": RUN_SEED, "dropout": 0.1}


def _secreq(fb: FedBroker, body: bytes) -> bytes:
    env = Envelope(Kind.SECAGG, FED, "coordinator", 1, 0, 1, len(body), hashlib.sha256(body).hexdigest(), body)
    return env.encode(fb.coordinator.signer())


def _from_dev_b(coord: Recorder, fb: FedBroker, kind: type, timeout: float) -> Any:
    """dev-b's next secure-round message of ``kind`` (its signature checked as the coordinator would)."""
    def match(m: Any) -> bool:
        if m.topic != T.secagg("dev-b"):
            return False
        env = decode_envelope(m.payload)
        return isinstance(decode_message(env.body), kind)

    got = coord.wait_message(match, timeout)
    return None if got is None else decode_message(decode_envelope(got.payload).body)


def test_a_bundle_signed_for_another_device_does_not_end_this_devices_round(tmp_path: Path, attack_fed: Any,
                                                                          digits_shard: Any) -> None:
    fed = attack_fed(IDS, federation=FED)  # mallory, the mistaken ACL
    shard = digits_shard(0)
    plan = Plan(1, IDS, time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100, seed=RUN_SEED,
                secure=_secure())
    planned = secure_from_plan(_secure(), 1, IDS, plan_digest=plan_digest(plan))  # bound to the plan, as devices do
    assert planned is not None
    server = SecAggServer(planned.params)
    peers = PeerKeys(FED, fed.devices["dev-a"].registry)

    def keys_of(d: str) -> DeviceConsistency:  # the other devices sign their adverts, as real ones do
        key = fed.devices[d].signer()
        return DeviceConsistency(survivor_signer(key, FED, 1, d), survivor_verifier(peers, FED, 1), 0.0,
                                 advert_signer(key, FED, 1, d), advert_verifier(peers, FED, 1))

    others = {d: SecAggClient(planned.params, d, consistency=keys_of(d)) for d in IDS if d != "dev-b"}
    coord = Recorder(fed.coordinator, [T.all_secagg()])
    mallory = fed.listen([f"{T.prefix}/secreq/#"])
    settings = EdgeSettings(state_dir=str(tmp_path / "dev-b"), client_index=1, device="cpu", heartbeat_s=2.0)
    client = EdgeClient(settings, fed.devices["dev-b"], shard)
    client.start()
    try:
        payload = encode_message(plan, FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), payload, retain=True)], 5)
        advert = _from_dev_b(coord, fed, KeyAdvert, 20)
        assert advert is not None, "dev-b sent no key advert on the secure plan"
        server.receive_advert(advert)
        for c in others.values():
            server.receive_advert(c.advertise())
        # the coordinator sends dev-a its bundle; mallory reads it there
        for_a = _secreq(fed, server.key_bundle("dev-a").to_bytes())
        assert coord.link.wait_published([coord.link.publish(T.secreq("dev-a"), for_a)], 5)
        assert mallory.wait_message(lambda m: m.topic == T.secreq("dev-a") and m.payload == for_a, 5) is not None
        # ... and moves it, signature intact, to dev-b's topic ahead of dev-b's own bundle
        assert mallory.link.wait_published([mallory.link.publish(T.secreq("dev-b"), for_a)], 5)
        assert mallory.wait_message(lambda m: m.topic == T.secreq("dev-b") and m.payload == for_a, 5) is not None, \
            "the broker did not deliver mallory's copy to dev-b's topic: the attack was not made"
        time.sleep(1.0)  # dev-b takes the copy first
        for_b = _secreq(fed, server.key_bundle("dev-b").to_bytes())
        assert coord.link.wait_published([coord.link.publish(T.secreq("dev-b"), for_b)], 5)
        shares = _from_dev_b(coord, fed, ShareBatch, 15)
        assert shares is not None, "dev-b sent no shares for its own bundle: the replayed copy ended its round"
        assert shares.device == "dev-b" and {s.receiver for s in shares.shares} == set(IDS) - {"dev-b"}
    finally:
        client.stop()
        coord.close()
        mallory.close()
