"""A coordinator that swaps a neighbour's keys in the bundle it sends a real edge client over Mosquitto
(docs/explanation/secure-aggregation.md, "Signed key adverts"; the in-process moves:
test_attack_secagg_signed_adverts.py).

The adversary is the coordinator: it holds its own signing key (so dev-b takes what it publishes on
``secreq/dev-b``), the adverts the devices sent it, and keys of its own. It sends dev-b a key bundle whose entry
for dev-a carries the coordinator's channel and mask keys, with dev-a's signature kept. The guarantee: dev-b, which
checks every entry against the federation's key registry (read in place in the broker's state folder), sends no
shares -- none sealed under the coordinator's key -- says in its log that the coordinator lied, and answers nothing
more in that round (the genuine bundle after it gets no shares either). Its own advert, signed toward each
neighbour, verifies against the same registry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import FedBroker, Recorder

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.peer_keys import PeerKeys
from flayer.engine.secure import round_ring, secure_from_plan
from flayer.secagg import (
    DeviceConsistency,
    KeyAdvert,
    SecAggClient,
    SecAggServer,
    ServerConsistency,
    ShareBatch,
    decode_message,
    keys,
)
from mqtt_broker import mosquitto_available
from protocol import Envelope, Kind, Plan, Topics, decode_envelope, encode_message
from protocol.plan_digest import plan_digest
from protocol.signing import advert_signer, advert_verifier, survivor_signer, survivor_verifier

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)
IDS = ("dev-a", "dev-b", "dev-c", "dev-d", "dev-e", "dev-f")
RUN_SEED = 7


def _secure() -> dict[str, Any]:
    seed = hashlib.sha256(f"secagg-graph:{RUN_SEED}:1".encode()).digest()
    return {"session": f"{FED}.1.ab", "threshold": 6, "degree": 5, "graph_seed": seed.hex(), "length": 8,
            "bits": round_ring(1.0, len(IDS), 16).bits, "value_bits": 16, "layout": "ab" * 32,
            "adaptive": False, "stage_s": 10.0, "noise_std": 0.0, "bound": 1.0, "value_range": 1.0,
            "corrupt_fraction": 0.0, "run_seed": RUN_SEED, "dropout": 0.1}


def _secreq(fb: FedBroker, body: bytes) -> bytes:
    env = Envelope(Kind.SECAGG, FED, "coordinator", 1, 0, 1, len(body), hashlib.sha256(body).hexdigest(), body)
    return env.encode(fb.coordinator.signer())


def _from_dev_b(coord: Recorder, kind: type, timeout: float) -> Any:
    def match(m: Any) -> bool:
        return m.topic == T.secagg("dev-b") and isinstance(decode_message(decode_envelope(m.payload).body), kind)

    got = coord.wait_message(match, timeout)
    return None if got is None else decode_message(decode_envelope(got.payload).body)


@pytest.mark.timeout(120)
def test_a_real_device_refuses_a_bundle_with_the_coordinators_keys(tmp_path: Path, attack_fed: Any,
                                                                   digits_shard: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    fed = attack_fed(IDS, view="coordinator", federation=FED)
    shard = digits_shard(0)
    plan = Plan(1, IDS, time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100, seed=RUN_SEED,
                secure=_secure())
    planned = secure_from_plan(_secure(), 1, IDS, plan_digest=plan_digest(plan))  # bound to the plan, as devices do
    assert planned is not None
    peers = PeerKeys(FED, fed.devices["dev-a"].registry)
    verify = advert_verifier(peers, FED, 1)
    server = SecAggServer(planned.params, ServerConsistency(verify))  # it checks what arrives, then lies

    def keys_of(d: str) -> DeviceConsistency:
        key = fed.devices[d].signer()
        return DeviceConsistency(survivor_signer(key, FED, 1, d), survivor_verifier(peers, FED, 1), 0.0,
                                 advert_signer(key, FED, 1, d), verify)

    others = {d: SecAggClient(planned.params, d, consistency=keys_of(d)) for d in IDS if d != "dev-b"}
    coord = fed.listen([T.all_secagg()])
    settings = EdgeSettings(state_dir=str(tmp_path / "dev-b"), client_index=1, device="cpu", heartbeat_s=2.0)
    client = EdgeClient(settings, fed.devices["dev-b"], shard)
    client.start()
    caplog.set_level(logging.WARNING, logger="edge_client.client")
    try:
        payload = encode_message(plan, FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), payload, retain=True)], 5)
        advert = _from_dev_b(coord, KeyAdvert, 20)
        assert advert is not None, "dev-b sent no key advert on the secure plan"
        server.receive_advert(advert)  # signed toward each of its 5 neighbours, under its registry key
        assert len(advert.signatures) == 5
        for c in others.values():
            server.receive_advert(c.advertise())
        honest = server.key_bundle("dev-b")
        mine = keys.generate_keypair(os.urandom), keys.generate_keypair(os.urandom)  # the coordinator's
        forged = tuple(dataclasses.replace(a, c_pk=mine[0].public, s_pk=mine[1].public) if a.device == "dev-a"
                       else a for a in honest.adverts)
        swapped = dataclasses.replace(honest, adverts=forged)
        assert coord.link.wait_published([coord.link.publish(T.secreq("dev-b"), _secreq(fed, swapped.to_bytes()))],
                                         5)
        assert _from_dev_b(coord, ShareBatch, 6) is None, "dev-b sealed its shares under the coordinator's keys"
        assert any("is not signed by dev-a's key" in r.getMessage() and "the coordinator lied" in r.getMessage()
                   for r in caplog.records), "dev-b did not say why it refused"
        assert coord.link.wait_published([coord.link.publish(T.secreq("dev-b"), _secreq(fed, honest.to_bytes()))], 5)
        assert _from_dev_b(coord, ShareBatch, 3) is None  # its round is over: the coordinator was caught lying
    finally:
        client.stop()
        coord.close()
