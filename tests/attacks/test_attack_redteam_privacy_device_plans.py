"""A coordinator that goes around a device's own budget with plans it may write (docs/explanation/privacy.md,
"A device's own budget").

The adversary holds the coordinator's credentials and signing key on a real broker. The device (the real edge
client, over its own connection) has ``[privacy] device_budget`` set in its device.toml -- room for two private
contributions at z = 1 and q = 1, counted at delta 1e-5 -- and names no delta. The adversary publishes, each
selecting the device:

1. a calibration plan (PLayer-FL's round 0), whose report is the device's un-noised sensitivity curve and its
   training-set size;
2. a training plan without privacy, whose upload is the device's un-clipped, un-noised update;
3. private plans, one after another, that name ``delta = 0.5``: at that delta every contribution costs almost
   nothing, so a device that took the plan's delta would never reach its budget.

It records every update and metrics message the device publishes. The guarantee: no calibration report, no
update outside a private round, and no more private contributions than the budget allows at the device's delta;
the refused rounds say only ``round skipped`` or ``budget spent``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from coordinator.publish import model_blob
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.work import StrategyCache
from flayer.engine import initial_global_state
from flayer.engine.accountant import epsilon_for
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
DEVICE, Z, DEVICE_DELTA, PRIVATE_ROUNDS = "dev-0", 1.0, 1e-5, 4


def _base(digits: Any, strategy: str, round_: int, phase: str) -> dict[str, Any]:
    return {"round": round_, "selected": (DEVICE,), "deadline": time.time() + 600, "strategy": strategy,
            "options": {}, "model": dataclasses.asdict(digits.model_spec()), "model_digest": "ab" * 32,
            "model_chunks": 1, "model_size": 1, "seed": 5, "rounds": PRIVATE_ROUNDS + 2, "phase": phase,
            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}


def _blob(digits: Any, strategy: str) -> Any:
    return model_blob(initial_global_state(StrategyCache({"device": "cpu"}).get(
        Plan(**_base(digits, strategy, 1, "train"))), 5))


def test_a_coordinator_cannot_go_around_the_device_budget(tmp_path: Path, digits: Any, attack_fed: Any,
                                                          digits_shard: Any) -> None:
    two, three = (epsilon_for([(Z, 1.0, n)], DEVICE_DELTA) for n in (2, 3))
    budget = (two + three) / 2
    shard = digits_shard(0, 3)
    fb = attack_fed([DEVICE], view="coordinator")  # the adversary: the coordinator's own account
    t = fb.coordinator
    topics = Topics(t.federation)
    adversary = fb.listen([f"fl/{t.federation}/update/{DEVICE}/#", f"fl/{t.federation}/status/{DEVICE}",
                             f"fl/{t.federation}/metrics/{DEVICE}"])
    settings = EdgeSettings(state_dir=str(tmp_path / DEVICE), device="cpu", threads=1, heartbeat_s=1.0,
                            ack_timeout_s=30.0, device_budget=budget)  # no delta of its own
    device = EdgeClient(settings, fb.devices[DEVICE], shard)
    blobs = {s: _blob(digits, s) for s in ("playerfl", "fedavg")}
    privacy = {**RoundPrivacy("central", 0.5, Z, Z, 1).as_plan(), "delta": 0.5}
    plans = [Plan(**_base(digits, "playerfl", 0, "calibrate")), Plan(**_base(digits, "fedavg", 1, "train"))]
    plans += [Plan(**{**_base(digits, "fedavg", r, "train"), "privacy": privacy}) for r in range(2, PRIVATE_ROUNDS + 2)]
    outcomes: dict[int, str] = {}
    try:
        for blob in blobs.values():
            chunks = chunk_blob(blob.blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload, blob.digest,
                                key=t.signer())
            assert adversary.link.publish_all([(topics.model_chunk(blob.digest, i), c, True)
                                               for i, c in enumerate(chunks)], 30)
        device.start()
        for plan in plans:
            blob = blobs[plan.strategy]
            chunks = len(chunk_blob(blob.blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload,
                                    blob.digest))
            plan = dataclasses.replace(plan, model_digest=blob.digest, model_size=blob.size, model_chunks=chunks)
            assert adversary.link.publish_all([(topics.round(), encode_message(plan, t.federation, t.username,
                                                                               key=t.signer()), True)], 30)

            def answered(ev: Any, r: int = plan.round) -> bool:
                if not isinstance(ev, Received) or not ev.payload:
                    return False
                env = decode_envelope(ev.payload)
                if env.kind in (Kind.UPDATE_CHUNK, Kind.METRICS) and env.round == r:
                    return True
                if env.kind == Kind.STATUS:
                    st = decode_message(ev.payload)[1]
                    return isinstance(st, Status) and st.info.get("skipped_round") == r
                return False

            ev = adversary.next(answered, 90)
            assert ev is not None, f"round {plan.round}: the device neither sent anything nor said it refused"
            env = decode_envelope(ev.payload)
            if env.kind == Kind.STATUS:
                st = decode_message(ev.payload)[1]
                assert isinstance(st, Status)
                outcomes[plan.round] = f"refused: {st.info['skip_reason']}"
                continue
            outcomes[plan.round] = "calibration report" if env.kind == Kind.METRICS else "update"
            ack = Ack(plan.round, DEVICE, env.digest, "accepted")
            adversary.link.publish(topics.ack(DEVICE), encode_message(ack, t.federation, t.username, key=t.signer()))
            time.sleep(0.5)  # the ack settles the upload
        assert device.error is None
    finally:
        device.stop()
        adversary.close()
    assert outcomes[0].startswith("refused"), f"the device sent its calibration report: {outcomes}"
    assert outcomes[1].startswith("refused"), f"the device sent an update in a round without privacy: {outcomes}"
    private = [r for r in range(2, PRIVATE_ROUNDS + 2) if outcomes[r] == "update"]
    assert private == [2, 3], f"private contributions {private} with a budget for two at delta {DEVICE_DELTA}"
    assert {outcomes[r] for r in (0, 1)} == {"refused: round skipped"}
    assert {outcomes[r] for r in range(4, PRIVATE_ROUNDS + 2)} == {"refused: budget spent"}
