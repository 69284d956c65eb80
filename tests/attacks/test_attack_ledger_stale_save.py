"""A late acknowledgement that writes a stale state file over a booked round (docs/explanation/privacy.md, "A
device's own budget"; edge_client/budget.py: the ledger is "written atomically with the upload: it survives
restarts and is never counted twice for one round").

The adversary holds the coordinator's credentials on a real Mosquitto (it is also the broker's operator, who may
delay any message): it signs local-mode private plans that select the device and reads its update topic. The
device is the real edge client on a slow uplink (its link shaper: 1.5 s before each publish, as a thin link).

1. Round 1: the device uploads; the adversary withholds the ack until the device gives up on it (``gave_up``).
2. Round 2: the device trains, books round 2 in its ledger, writes its state file (done round 2, the upload of
   round 2 pending) and announces the upload. The adversary now sends the ack of round 1 it withheld. The device's
   worker answers it while the job thread is still sending round 2, and writes the state file from the
   ``StoredState`` it still holds: done round 1, the upload of round 1 -- with the ledger that already counts
   round 2 (the two share one ``extra`` dict). Nothing rewrites the file until round 2 is acknowledged or given
   up on.
3. The device loses power in that window (``crash``) and reboots from its state folder: round 2's plan is still
   retained, done round 1 says it has not trained it, the ledger's last round 2 lets the schema pass it as "a
   re-sent upload", and ``DeviceLedger.record`` ignores it as counted already -- so it trains round 2 again,
   draws fresh noise and sends a second, different upload of round 2.

The guarantee: every private upload that leaves the device is in its ledger once -- no two different uploads
of one round (the coordinator, averaging two noise draws over the same clipped update, halves their variance
while the device books one).

Found by a red team: on the code before, the device sent two different uploads of round 2 while its ledger counted
2 private rounds for the 3 uploads that left it. Now the late ack does not write the state file while a job is under
way, and a device refuses to train any round at or before its ledger's last one.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from attacklib import until

from coordinator.publish import model_blob
from edge_client.budget import DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore
from edge_client.work import StrategyCache
from flayer.engine import initial_global_state
from flayer.engine.privacy import RoundPrivacy
from protocol import (
    Ack,
    Kind,
    Plan,
    Status,
    Topics,
    chunk_blob,
    decode_envelope,
    decode_message,
    encode_message,
)
from transport.link import Received

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 20 s
DEVICE, Z, DELTA = "dev-0", 1.0, 1e-3


def _plans(digits: Any) -> tuple[list[Plan], bytes]:
    spec = dataclasses.asdict(digits.model_spec())
    base: dict[str, Any] = {"round": 1, "selected": (DEVICE,), "deadline": time.time() + 600, "strategy": "fedavg",
                            "options": {}, "model": spec, "model_digest": "ab" * 32, "model_chunks": 1,
                            "model_size": 1, "seed": 5, "rounds": 4,
                            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))
    blob = model_blob(initial_global_state(strategy, 5))
    privacy = {**RoundPrivacy("local", 0.5, Z, Z, 1).as_plan(), "delta": DELTA}
    return [Plan(**{**base, "round": r, "model_digest": blob.digest, "model_size": blob.size, "privacy": privacy})
            for r in (1, 2)], blob.blob


def test_a_late_ack_cannot_get_one_round_uploaded_twice(tmp_path: Path, digits: Any, attack_fed: Any,
                                                        digits_shard: Any) -> None:
    plans, blob = _plans(digits)
    shard = digits_shard(0, 3)
    fb = attack_fed([DEVICE], view="coordinator")
    t = fb.coordinator
    topics = Topics(t.federation)
    adversary = fb.listen([f"fl/{t.federation}/update/{DEVICE}/#", f"fl/{t.federation}/status/{DEVICE}"])
    state_dir = tmp_path / DEVICE
    settings = EdgeSettings(state_dir=str(state_dir), device="cpu", threads=1, heartbeat_s=1.0, ack_timeout_s=4.0,
                            retries=0, backoff_s=0.1, backoff_max_s=0.2)

    def slow_uplink(nbytes: int, direction: str) -> float:
        return 1.5 if direction == "up" else 0.0

    uploads: dict[int, list[str]] = {}

    def chunk_of(ev: Any, r: int, seen: list[str]) -> bool:
        if not isinstance(ev, Received) or not ev.payload:
            return False
        env = decode_envelope(ev.payload)
        return env.kind == Kind.UPDATE_CHUNK and env.round == r and env.digest not in seen

    def uploading(ev: Any, r: int) -> bool:
        if not isinstance(ev, Received) or not ev.payload or decode_envelope(ev.payload).kind != Kind.STATUS:
            return False
        st = decode_message(ev.payload)[1]
        return isinstance(st, Status) and st.info.get("upload_round") == r

    def publish_plan(plan: Plan) -> None:
        assert adversary.link.publish_all([(topics.round(), encode_message(plan, t.federation, t.username,
                                                                           key=t.signer()), True)], 30)

    chunks = chunk_blob(blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload, plans[0].model_digest,
                        key=t.signer())
    assert adversary.link.publish_all([(topics.model_chunk(plans[0].model_digest, i), c, True)
                                       for i, c in enumerate(chunks)], 30)
    plans = [dataclasses.replace(p, model_chunks=len(chunks)) for p in plans]
    device = EdgeClient(settings, fb.devices[DEVICE], shard, shaper=slow_uplink)
    device.start()
    store = DeviceStore(state_dir)
    try:
        publish_plan(plans[0])  # 1. round 1, never acknowledged in time
        ev = adversary.next(lambda e: chunk_of(e, 1, []), 60)
        assert ev is not None, "the device sent no upload for round 1"
        first = decode_envelope(ev.payload).digest
        assert until(lambda: (u := store.load().upload) is not None and u.round == 1 and u.status == "gave_up", 30)

        publish_plan(plans[1])  # 2. round 2; the withheld ack of round 1 arrives while round 2 goes out
        assert adversary.next(lambda e: uploading(e, 2), 60) is not None, "the device did not start round 2's upload"
        ack = Ack(1, DEVICE, first, "accepted")
        adversary.link.publish(topics.ack(DEVICE), encode_message(ack, t.federation, t.username, key=t.signer()))
        ev = adversary.next(lambda e: chunk_of(e, 2, []), 60)
        assert ev is not None, "the device sent no upload for round 2"
        uploads[2] = [decode_envelope(ev.payload).digest]
        time.sleep(0.3)

        device.crash()  # 3. a power loss before round 2 is acknowledged; the reboot resumes from the state folder
        assert device.wait(30)
        device = EdgeClient(settings, fb.devices[DEVICE], shard, shaper=slow_uplink)
        device.start()
        ev = adversary.next(lambda e: chunk_of(e, 2, uploads[2]), 20)
        if ev is not None:
            uploads[2].append(decode_envelope(ev.payload).digest)
        time.sleep(0.5)
        ledger = DeviceLedger.from_extra(store.load().extra)
        assert len(uploads[2]) == 1, (
            f"the device sent {len(uploads[2])} different private uploads of round 2 (fresh noise on the same "
            f"clipped update each time) while its ledger counts {ledger.rounds} private rounds for the 3 uploads "
            f"that left it (runs {ledger.runs}, last round {ledger.last_round})")
    finally:
        device.stop()
        adversary.close()
