"""A device's old signing key, after ``flayer broker rekey`` (docs/explanation/security.md, "Keys": the
coordinator reads the registry again when it changes, so an old key is refused from then on).

The adversary holds dev-b's old private key (the reason an operator re-keys a device: a kit copied, a device
lost for a while) and, through a too-broad ACL (read and write on every topic of the federation, as a
mistaken ACL, a bridge or a broker defect would give it), writes under dev-b's id. The operator re-keys dev-b
while the coordinator runs. The adversary's update for the open round, signed with the old key, must be
refused before anything is journaled (counter ``unsigned``); dev-b's update signed with its new key is
accepted. A real coordinator on a real Mosquitto.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedtestlib import Recorder

from coordinator.journal import journal_path, read_journal
from flayer.update import TensorDelta, Update
from mqtt_broker import mosquitto_available
from mqtt_broker.rekey import rekey
from protocol import (
    Kind,
    Plan,
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


def _update(plan: Plan, value: float) -> bytes:
    upd = Update({"fc.bias": TensorDelta((10,), np.float32([value, -value]), np.array([0, 7]))}, 50,
                 {"test_correct": 1.0, "test_total": 4.0})
    return encode_update(upd, UpdateHeader(FED, plan.round, "dev-b", plan.model_digest))


def _send(rec: Recorder, plan: Plan, blob: bytes, key: object) -> None:
    infos = [rec.link.publish(T.update_chunk("dev-b", plan.round, i), p)
             for i, p in enumerate(chunk_blob(blob, Kind.UPDATE_CHUNK, FED, "dev-b", plan.round, 400, key=key))]
    assert rec.link.wait_published(infos, 5)


def test_an_update_signed_with_a_devices_old_key_is_refused_after_rekey(tmp_path: Path,
                                                                        attack_fed: Any) -> None:
    fed = attack_fed(["dev-b"], federation=FED)  # mallory, the mistaken ACL
    old_key = fed.devices["dev-b"].signer()  # what the adversary copied
    coord = fed.coordinator_in(strategy="fedavg", rounds=1, dataset="digits", quorum=1, min_devices=1,
                               deadline_s=60.0)
    thread = coord.thread
    b = Recorder(fed.devices["dev-b"], [T.round(), T.ack("dev-b")])
    mallory = fed.listen([f"{T.prefix}/#"])
    try:
        assert b.link.wait_published([b.link.publish(
            T.status("dev-b"), encode_message(Status(0, "online", time.time()), FED, "dev-b", key=old_key),
            retain=True)], 5)
        msg = b.wait_message(lambda m: m.topic == T.round() and bool(m.payload), 60)
        assert msg is not None, "no plan"
        plan = decode_message(msg.payload)[1]
        assert isinstance(plan, Plan) and plan.selected == ("dev-b",)
        new_key = rekey(fed.state_dir, "dev-b").signer()  # the operator re-keys dev-b
        assert new_key.public != old_key.public
        time.sleep(1.5)  # the coordinator reads the registry at most every 0.5 s
        refused = coord.counters["unsigned"]
        forged = _update(plan, 9.0)
        _send(mallory, plan, forged, old_key)
        deadline = time.monotonic() + 10
        while coord.counters["unsigned"] == refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.counters["unsigned"] > refused, f"the old key's update was not refused: {dict(coord.counters)}"
        assert coord.open is not None and not coord.open.accepted, "the update signed with the old key was accepted"
        # positive control: dev-b's update signed with its new key is accepted and closes the round
        genuine = _update(plan, 0.5)
        _send(b, plan, genuine, new_key)
        thread.join(60)
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        replay = read_journal(journal_path(tmp_path / "coord/journal", plan.round))
        assert [(r.client, blob_digest(r.data)) for r in replay.updates] == [("dev-b", blob_digest(genuine))]
    finally:
        b.close()
        mallory.close()
        coord.stop()
