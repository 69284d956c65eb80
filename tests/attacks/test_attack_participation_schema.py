"""A coordinator that breaks the participation schema (docs/explanation/privacy.md, "The participation schema").

The adversary holds the coordinator's credentials on a real Mosquitto: it signs and publishes private plans of
its own choosing, each selecting the device under attack, serves the model, acknowledges every update and
counts what arrives on the device's update topic. The devices are real edge clients over their own
connections. The guarantees:

- a device selected beyond the plan's ``max_participations`` k, or within ``min_separation`` b rounds of its
  last contribution, sends nothing for that round and its ledger does not move (the accountant composes k
  rounds a device, not one per round: a coordinator drawing more contributions would spend more than printed);
- a device whose ``device.toml`` pins a schema refuses a plan that names none, or a looser one (a larger k, a
  smaller b) -- the coordinator cannot loosen the schema by writing the plan -- and contributes to a plan that
  names its pinned schema.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fedtestlib import Recorder, start_fed_broker

from coordinator.publish import model_blob
from edge_client.budget import DeviceLedger
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.work import StrategyCache
from flayer.engine import initial_global_state
from flayer.engine.privacy import RoundPrivacy
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import mosquitto_available
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

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GREEDY, PINNED, Z, DELTA = "dev-greedy", "dev-pinned", 1.0, 1e-3


def _base(digits: Any, device: str) -> tuple[Plan, bytes]:
    spec = dataclasses.asdict(digits.model_spec())
    base: dict[str, Any] = {"round": 1, "selected": (device,), "deadline": time.time() + 600, "strategy": "fedavg",
                            "options": {}, "model": spec, "model_digest": "ab" * 32, "model_chunks": 1,
                            "model_size": 1, "seed": 5, "rounds": 20,
                            "train": {"lr": 0.05, "batch_size": 10, "local_epochs": 1}}
    strategy = StrategyCache({"device": "cpu"}).get(Plan(**base))
    blob = model_blob(initial_global_state(strategy, 5))
    return Plan(**{**base, "model_digest": blob.digest, "model_size": blob.size}), blob.blob


def _privacy(**schema: int) -> dict[str, Any]:
    return {**RoundPrivacy("central", 0.5, Z, Z, 1).as_plan(), "delta": DELTA, **schema}


class _Adversary:
    """The coordinator's credentials: signed plans of its choosing, acks for whatever arrives."""

    def __init__(self, fb: Any, device: str, base: Plan, blob: bytes) -> None:
        t = self.t = fb.coordinator
        self.device, self.topics = device, Topics(t.federation)
        self.rec = Recorder(t, [f"fl/{t.federation}/update/{device}/#", f"fl/{t.federation}/status/{device}"])
        chunks = chunk_blob(blob, Kind.MODEL_CHUNK, t.federation, t.username, 1, t.max_payload, base.model_digest,
                            key=t.signer())
        assert self.rec.link.publish_all([(self.topics.model_chunk(base.model_digest, i), c, True)
                                          for i, c in enumerate(chunks)], 30)
        self.base = dataclasses.replace(base, model_chunks=len(chunks))

    def ask(self, round_: int, privacy: dict[str, Any]) -> bool:
        """Publish a plan selecting the device in ``round_``: True when it contributed, False when it refused."""
        plan = dataclasses.replace(self.base, round=round_, privacy=privacy, selected=(self.device,))
        assert self.rec.link.publish_all([(self.topics.round(), encode_message(plan, self.t.federation,
                                                                                self.t.username, key=self.t.signer()),
                                           True)], 30)

        def answered(ev: Any) -> bool:
            if not isinstance(ev, Received) or not ev.payload:
                return False
            env = decode_envelope(ev.payload)
            if env.kind == Kind.UPDATE_CHUNK and env.round == round_:
                return True
            if env.kind == Kind.STATUS:
                st = decode_message(ev.payload)[1]
                return isinstance(st, Status) and st.info.get("skipped_round") == round_
            return False

        ev = self.rec.next(answered, 60)
        assert ev is not None, f"round {round_}: the device neither sent an update nor said it refused"
        env = decode_envelope(ev.payload)
        if env.kind != Kind.UPDATE_CHUNK:
            st = decode_message(ev.payload)[1]
            assert isinstance(st, Status) and st.info["skip_reason"] == "round skipped"  # nothing more specific
            return False
        ack = Ack(round_, self.device, env.digest, "accepted")
        self.rec.link.publish(self.topics.ack(self.device), encode_message(ack, self.t.federation, self.t.username,
                                                                           key=self.t.signer()))
        time.sleep(0.5)  # the ack settles the upload
        return True

    def close(self) -> None:
        self.rec.close()


def _run(tmp_path: Path, digits: Any, device_id: str, settings: EdgeSettings,
         plans: list[tuple[int, dict[str, Any]]]) -> tuple[list[int], DeviceLedger]:
    base, blob = _base(digits, device_id)
    shard = client_data(digits, make_partition(digits.y, 10, 3, "iid", 0).clients[0])
    fb = start_fed_broker(tmp_path, "mosquitto", [device_id])
    adversary = _Adversary(fb, device_id, base, blob)
    device = EdgeClient(settings, fb.devices[device_id], shard)
    contributed: list[int] = []
    try:
        device.start()
        for r, privacy in plans:
            if adversary.ask(r, privacy):
                contributed.append(r)
        assert device.error is None
    finally:
        device.stop()
        device.wait(30)
        adversary.close()
        fb.broker.stop()
    return contributed, DeviceLedger.from_extra(device.stored.extra)


def test_a_coordinator_cannot_draw_contributions_beyond_k_or_within_b(tmp_path: Path, digits: Any) -> None:
    if not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    schema = _privacy(max_participations=2, min_separation=3)
    settings = EdgeSettings(state_dir=str(tmp_path / GREEDY), device="cpu", threads=1, heartbeat_s=1.0,
                            ack_timeout_s=30.0, device_delta=DELTA)
    # round 2 is within 3 rounds of round 1; rounds 5 and 9 would be a third participation
    contributed, ledger = _run(tmp_path, digits, GREEDY, settings,
                               [(1, schema), (2, schema), (4, schema), (5, schema), (9, schema)])
    assert contributed == [1, 4], f"the device contributed to rounds {contributed} under k = 2, b = 3"
    assert (ledger.rounds, ledger.last_round) == (2, 4), "a refused round moved the device's ledger"


def test_a_coordinator_cannot_loosen_the_schema_a_device_pins(tmp_path: Path, digits: Any) -> None:
    if not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    settings = EdgeSettings(state_dir=str(tmp_path / PINNED), device="cpu", threads=1, heartbeat_s=1.0,
                            ack_timeout_s=30.0, device_delta=DELTA, max_participations=2, min_separation=3)
    plans = [(1, _privacy()),  # the schema removed
             (2, _privacy(max_participations=5, min_separation=3)),  # k loosened
             (3, _privacy(max_participations=2, min_separation=1)),  # b loosened
             (4, _privacy(min_separation=3)),  # k removed
             (5, _privacy(max_participations=2, min_separation=3)),  # the pinned schema: it takes part
             (6, _privacy(max_participations=1, min_separation=9))]  # tighter: its own second round breaks k = 1
    contributed, ledger = _run(tmp_path, digits, PINNED, settings, plans)
    assert contributed == [5], f"the device contributed to rounds {contributed}; only round 5 names its schema"
    assert (ledger.rounds, ledger.last_round) == (1, 5)
