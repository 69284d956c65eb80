"""Authenticity over a real Mosquitto: the broker is trusted for delivery only.

The adversary is ``mallory``, a device of the federation whose broker account was given a too-broad ACL
(read and write on every topic of the federation, as a mistaken ACL, a bridge or a broker defect would give
it). Mallory holds its own signing key and whatever it read from the broker -- never the coordinator's or
another device's key. What it publishes:

- a plan, an ack and a plan naming its own model on the coordinator's topics, unsigned or signed with its own
  key: every device refuses them; a device keeps its unacknowledged upload;
- a signed plan of an earlier round, replayed, and a plan signed for another federation: refused;
- an update under another device's id (unsigned, or signed with its own key): refused by the coordinator,
  nothing journaled;
- an update a revoked device signed with its (former) key: refused.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attacklib import widen_acl
from fedtestlib import FedBroker, Recorder

from coordinator.journal import journal_path, read_journal
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore, StoredState, UploadRecord
from flayer.update import TensorDelta, Update
from mqtt_broker import mosquitto_available
from mqtt_broker.kit import revoke_device
from protocol import (
    Ack,
    Kind,
    Plan,
    SigningKey,
    Status,
    Topics,
    UpdateHeader,
    blob_digest,
    chunk_blob,
    decode_message,
    encode_message,
    encode_update,
)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)


def _delivered(mallory: Recorder, topic: str, payload: bytes) -> None:
    """Positive control: the broker took mallory's message and delivers it (mallory reads it back)."""
    assert mallory.wait_message(lambda m: m.topic == topic and m.payload == payload, 5) is not None, \
        f"the broker did not deliver mallory's message on {topic}: the attack was not made"


def _plan(round_: int, selected: tuple[str, ...] = ("dev-a",), digest: str = "ab" * 32) -> Plan:
    return Plan(round_, selected, time.time() + 600, "fedavg", {}, {"name": "mlp"}, digest, 1, 100)


def _publish(rec: Recorder, topic: str, payload: bytes, retain: bool = False) -> None:
    assert rec.link.wait_published([rec.link.publish(topic, payload, retain=retain)], 5)
    if rec.link.settings.username == "mallory":
        _delivered(rec, topic, payload)


def _device(tmp: Path, fb: FedBroker, upload_round: int, shard: Any) -> tuple[EdgeClient, str]:
    """dev-a, restarted with an upload of ``upload_round`` the coordinator never acknowledged."""
    state = tmp / "dev-a"
    store = DeviceStore(state)
    blob = b"the update dev-a trained" * 8
    store.save_upload(blob)
    store.save(StoredState(None, upload_round, UploadRecord(upload_round, blob_digest(blob), len(blob)), False, {}))
    settings = EdgeSettings(state_dir=str(state), client_index=0, device="cpu", heartbeat_s=2.0, ack_timeout_s=600)
    client = EdgeClient(settings, fb.devices["dev-a"], shard)
    client.start()
    return client, blob_digest(blob)


def _resent(server: Recorder, round_: int) -> None:
    """Positive control: dev-a took the genuine plan (it re-sends its upload, signed with its key)."""
    msg = server.wait_message(lambda m: m.topic.startswith(f"{T.prefix}/update/dev-a/{round_}/"), 15)
    assert msg is not None, "dev-a did not re-send its upload on the genuine plan"


def _holds(client: EdgeClient, round_: int, digest: str, plan_round: int) -> None:
    up = client.stored.upload
    assert up is not None and not up.settled and (up.round, up.digest) == (round_, digest), \
        f"dev-a dropped or settled its unacknowledged upload: {up}"
    assert client.plan is not None and client.plan.round == plan_round, \
        f"dev-a took a plan of round {client.plan.round if client.plan else None}"


def test_plan_ack_and_model_without_the_coordinators_key_are_refused(tmp_path: Path, attack_fed: Any,
                                                                     digits_shard: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b", "dev-c"], federation=FED)  # mallory, the mistaken ACL
    shard = digits_shard(0)
    coord_key = fed.coordinator.signer()  # the genuine coordinator (the test plays it)
    mallory_key = fed.devices["mallory"].signer()
    server = Recorder(fed.coordinator, [T.all_updates()])
    mallory = fed.listen([f"{T.prefix}/#"])
    client, digest = _device(tmp_path, fed, 1, shard)
    try:
        _publish(server, T.round(), encode_message(_plan(1), FED, "coordinator", key=coord_key), retain=True)
        _resent(server, 1)
        # a plan of a later round (it would make dev-a drop its upload), unsigned and signed by mallory
        forged_model = b"mallory's model"
        for key in (None, mallory_key):
            plan = _plan(5, digest=blob_digest(forged_model))
            _publish(mallory, T.round(), encode_message(plan, FED, "coordinator", key=key), retain=True)
            for i, p in enumerate(chunk_blob(forged_model, Kind.MODEL_CHUNK, FED, "coordinator", 5, 4096, key=key)):
                _publish(mallory, T.model_chunk(blob_digest(forged_model), i), p, retain=True)
            # an ack that would settle dev-a's upload
            _publish(mallory, T.ack("dev-a"), encode_message(Ack(1, "dev-a", digest, "accepted"), FED,
                                                             "coordinator", key=key))
        time.sleep(1.5)
        _holds(client, 1, digest, 1)
        assert client.error is None and client._download is None, "dev-a fetched mallory's model"
    finally:
        client.stop()
        server.close()
        mallory.close()


def test_replayed_and_foreign_plans_are_refused(tmp_path: Path, attack_fed: Any, digits_shard: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b", "dev-c"], federation=FED)  # mallory, the mistaken ACL
    shard = digits_shard(0)
    coord_key = fed.coordinator.signer()
    server = Recorder(fed.coordinator, [T.all_updates()])
    mallory = fed.listen([f"{T.prefix}/#"])
    # what mallory recorded earlier: the coordinator's signed plan of round 1
    old = encode_message(_plan(1), FED, "coordinator", key=coord_key)
    client, digest = _device(tmp_path, fed, 3, shard)
    try:
        _publish(server, T.round(), encode_message(_plan(3), FED, "coordinator", key=coord_key), retain=True)
        _resent(server, 3)
        _publish(mallory, T.round(), old, retain=True)  # replayed: an earlier round
        # a plan of another federation: signed by its coordinator, or by this key for that federation
        other = SigningKey.generate()
        for key, fed_id in ((other, "other-fed"), (coord_key, "other-fed"), (other, FED)):
            _publish(mallory, T.round(), encode_message(_plan(7), fed_id, "coordinator", key=key), retain=True)
        time.sleep(1.5)
        _holds(client, 3, digest, 3)
    finally:
        client.stop()
        server.close()
        mallory.close()


def _update(plan: Plan, sender: str, value: float) -> bytes:
    upd = Update({"fc.bias": TensorDelta((10,), np.float32([value, -value]), np.array([0, 7]))}, 50,
                 {"test_correct": 1.0, "test_total": 4.0})
    return encode_update(upd, UpdateHeader(FED, plan.round, sender, plan.model_digest))


def test_updates_not_signed_by_their_device_are_refused_and_not_journaled(tmp_path: Path,
                                                                          attack_fed: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b", "dev-c"], federation=FED)  # mallory, the mistaken ACL
    revoked_key = fed.devices["dev-c"].signer()  # dev-c's key, before it is revoked
    assert revoke_device(fed.state_dir, "dev-c")  # (rewrites the ACL: mallory's mistaken rule goes back in)
    widen_acl(fed, "mallory")
    coord = fed.coordinator_in(strategy="fedavg", rounds=1, dataset="digits", quorum=1, min_devices=1,
                               deadline_s=60.0)
    thread = coord.thread
    b_key = fed.devices["dev-b"].signer()
    b = Recorder(fed.devices["dev-b"], [T.round(), T.ack("dev-b")])
    mallory = fed.listen([f"{T.prefix}/#"])
    try:
        _publish(b, T.status("dev-b"), encode_message(Status(0, "online", time.time()), FED, "dev-b", key=b_key),
                 retain=True)
        msg = b.wait_message(lambda m: m.topic == T.round() and bool(m.payload), 60)
        assert msg is not None, "no plan"
        plan = decode_message(msg.payload)[1]
        assert isinstance(plan, Plan) and plan.selected == ("dev-b",)
        mallory_key = fed.devices["mallory"].signer()
        forged = _update(plan, "dev-b", 9.0)
        for key in (None, mallory_key):  # under dev-b's id: unsigned, signed by mallory
            for i, p in enumerate(chunk_blob(forged, Kind.UPDATE_CHUNK, FED, "dev-b", plan.round, 400, key=key)):
                _publish(mallory, T.update_chunk("dev-b", plan.round, i), p)
        # the revoked dev-c's update, signed with its former key
        for i, p in enumerate(chunk_blob(_update(plan, "dev-c", 7.0), Kind.UPDATE_CHUNK, FED, "dev-c", plan.round,
                                         400, key=revoked_key)):
            _publish(mallory, T.update_chunk("dev-c", plan.round, i), p)
        deadline = time.monotonic() + 10
        while (coord.counters["unsigned"] < 2 or not coord.counters["revoked"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.counters["unsigned"] >= 2 and coord.counters["revoked"] >= 1, dict(coord.counters)
        assert coord.open is not None and not coord.open.accepted, "a forged update was accepted"
        # positive control: dev-b's own update, signed with its key, is accepted and closes the round
        genuine = _update(plan, "dev-b", 0.5)
        for i, p in enumerate(chunk_blob(genuine, Kind.UPDATE_CHUNK, FED, "dev-b", plan.round, 400, key=b_key)):
            _publish(b, T.update_chunk("dev-b", plan.round, i), p)
        thread.join(60)
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        replay = read_journal(journal_path(tmp_path / "coord/journal", plan.round))
        assert [(r.client, blob_digest(r.data)) for r in replay.updates] == [("dev-b", blob_digest(genuine))]
    finally:
        b.close()
        mallory.close()
        coord.stop()
