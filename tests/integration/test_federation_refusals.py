"""What the federation refuses, on a live Mosquitto with the real coordinator and edge client classes:
wrong passwords, one device writing or reading another's traffic, an oversize update (refused on the
device before sending), an update for a past round (acked ``late`` and counted), a duplicate (acked
``duplicate``, folded once), forged and garbage chunks (counted); and a coordinator restarted
mid-round that replays its journal."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedtestlib import FedBroker, Recorder, federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.journal import journal_path, read_journal
from coordinator.publish import model_blob
from coordinator.server import Coordinator, CoordinatorError
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.work import EdgeError, UpdateTooLarge
from flayer.partition import make_partition
from flayer.engine import initial_global_state
from flayer.train import client_data
from flayer.update import TensorDelta, Update
from mqtt_broker import Credentials, mosquitto_available
from protocol import (
    Ack,
    Kind,
    Plan,
    Status,
    Topics,
    UpdateHeader,
    blob_digest,
    chunk_blob,
    decode_message,
    decode_update,
    encode_message,
    encode_update,
)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
DEVICES = ["dev-a", "dev-b", "dev-c"]
T = Topics("itest")


@pytest.fixture
def fed(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A fresh broker per test (0.1 s to start): no session or retained message leaks between tests."""
    fb = start_fed_broker(tmp_path, "mosquitto", DEVICES)
    yield fb
    fb.broker.stop()


@pytest.fixture(scope="module")
def shards(digits):  # type: ignore[no-untyped-def]
    part = make_partition(digits.y, digits.num_classes, 3, "iid", 0)
    return [client_data(digits, c) for c in part.clients]


def _coordinator(tmp: Path, fb: FedBroker, **kw: Any) -> Coordinator:
    args: dict[str, Any] = dict(strategy="fedavg", rounds=1, dataset="digits")
    args.update(kw)
    path = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                           **args)
    return Coordinator(load_coordinator_config(path), fb.coordinator)


def _edge(tmp: Path, creds: Credentials, data: Any, index: int, **kw: Any) -> EdgeClient:
    settings = EdgeSettings(state_dir=str(tmp / creds.username), client_index=index, device="cpu", heartbeat_s=2.0,
                            **kw)
    return EdgeClient(settings, creds, data)


class ManualDevice:
    """A device driven by the test: presence, plans, hand-made updates, acks."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self.rec = Recorder(creds, [T.round(), T.ack(creds.username)])
        self.key = creds.signer()  # the device's own key, from its credentials
        payload = encode_message(Status(0, "online", time.time()), "itest", creds.username, key=self.key)
        self.rec.link.wait_published([self.rec.link.publish(T.status(creds.username), payload, retain=True)], 5)

    def plan(self, round_: int, timeout: float = 60.0) -> Plan:
        def is_plan(m: Any) -> bool:
            return m.topic == T.round() and bool(m.payload) and decode_message(m.payload)[1].round == round_

        msg = self.rec.wait_message(is_plan, timeout)
        assert msg is not None, f"no plan for round {round_}"
        plan = decode_message(msg.payload)[1]
        assert isinstance(plan, Plan)
        return plan

    def update_blob(self, plan: Plan, round_: int, value: float) -> bytes:
        upd = Update({"fc.bias": TensorDelta((10,), np.float32([value, -value]), np.array([0, 7]))}, 50,
                     {"test_correct": 1.0, "test_total": 4.0})
        return encode_update(upd, UpdateHeader("itest", round_, self.creds.username, plan.model_digest))

    def send(self, blob: bytes, round_: int) -> str:
        me = self.creds.username
        payloads = chunk_blob(blob, Kind.UPDATE_CHUNK, "itest", me, round_, 400, key=self.key)  # several chunks
        items = [(T.update_chunk(me, round_, i), p, False) for i, p in enumerate(payloads)]
        assert self.rec.link.publish_all(items, 10.0)
        return blob_digest(blob)

    def ack(self, digest: str, status: str | None = None, timeout: float = 20.0) -> Ack:
        def is_ack(m: Any) -> bool:
            if m.topic != T.ack(self.creds.username):
                return False
            a = decode_message(m.payload)[1]
            return a.update_digest == digest and (status is None or a.status == status)

        msg = self.rec.wait_message(is_ack, timeout)
        assert msg is not None, f"no {status or ''} ack for {digest[:12]}"
        ack = decode_message(msg.payload)[1]
        assert isinstance(ack, Ack)
        return ack

    def close(self) -> None:
        self.rec.link.publish(T.status(self.creds.username), b"", retain=True)
        self.rec.close()


def test_wrong_password_is_refused(tmp_path: Path, fed: FedBroker, shards: list) -> None:
    bad = dataclasses.replace(fed.devices["dev-a"], password=fed.devices["dev-a"].password + "x")
    client = _edge(tmp_path, bad, shards[0], 0)
    t0 = time.monotonic()
    with pytest.raises(EdgeError, match="refused"):
        client.run()
    assert time.monotonic() - t0 < 20
    coord = _coordinator(tmp_path, fed)
    coord.creds = dataclasses.replace(fed.coordinator, password="not-it")
    from transport.credentials import mqtt_connect_settings
    from transport.link import MqttLink

    coord.link = MqttLink(mqtt_connect_settings(coord.creds), coord.events.put)
    coord.publishing.publisher.link = coord.link
    with pytest.raises(CoordinatorError, match="refused"):
        coord.run()


def test_a_device_cannot_write_or_read_another_devices_updates(fed: FedBroker) -> None:
    server = Recorder(fed.coordinator, [T.all_updates()])
    a = Recorder(fed.devices["dev-a"], [f"{T.prefix}/update/#", T.ack("dev-b"), f"{T.prefix}/ack/#"])
    b = Recorder(fed.devices["dev-b"], [T.ack("dev-b")])
    try:
        a.link.wait_published([a.link.publish(T.update_chunk("dev-b", 1, 0), b"forged by a")], 5)
        a.link.wait_published([a.link.publish(T.update_chunk("dev-a", 1, 0), b"genuine a")], 5)
        b.link.wait_published([b.link.publish(T.update_chunk("dev-b", 1, 0), b"genuine b")], 5)
        server.link.wait_published([server.link.publish(T.ack("dev-b"), b"ack for b")], 5)
        assert server.wait_message(lambda m: m.payload == b"genuine b") is not None  # positive controls
        assert server.wait_message(lambda m: m.payload == b"genuine a") is not None
        assert b.wait_message(lambda m: m.payload == b"ack for b") is not None
        time.sleep(0.8)  # let anything that should not arrive show up
        assert all(m.payload != b"forged by a" for m in server.drain(0.1))
        assert [m.topic for m in a.drain(0.1)] == [], "dev-a read another device's update or ack"
    finally:
        for r in (server, a, b):
            r.close()


def test_oversize_update_is_refused_before_sending(tmp_path: Path, fed: FedBroker, shards: list) -> None:
    coord = _coordinator(tmp_path, fed, max_update_bytes=20_000, max_pending_bytes=1 << 20, deadline_s=4.0)
    thread = coord.start()
    client = _edge(tmp_path, fed.devices["dev-a"], shards[0], 0)
    try:
        with pytest.raises(UpdateTooLarge, match=r"the limit is 20,000 bytes\. Nothing was sent"):
            client.run()
        thread.join(60)
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        (rec,) = result.history
        assert rec["received"] == 0 and rec["bytes_in"] == 0 and rec["accepted"] == 0
        assert "deadline" in rec["closed"]
    finally:
        client.stop()
        coord.stop()


def test_past_round_duplicate_forged_and_garbage(tmp_path: Path, fed: FedBroker, shards: list) -> None:
    coord = _coordinator(tmp_path, fed, rounds=2, quorum=2, min_devices=2, deadline_s=90.0)
    thread = coord.start()
    b = ManualDevice(fed.devices["dev-b"])
    client = _edge(tmp_path, fed.devices["dev-a"], shards[0], 0)
    client.start()
    try:
        plan1 = b.plan(1)
        assert plan1.selected == ("dev-a", "dev-b") and plan1.phase == "train" and plan1.rounds == 2
        blob1 = b.update_blob(plan1, 1, 0.5)
        d1 = b.send(blob1, 1)
        assert b.ack(d1).status == "accepted"
        b.rec.messages.clear()
        b.send(blob1, 1)  # the same update again (as after a lost ack)
        dup = b.ack(d1)
        assert dup.status == "duplicate" and "already folded" in dup.reason
        plan2 = b.plan(2)  # dev-a reported too: round 1 closed
        late_blob = b.update_blob(plan1, 1, 0.25)  # dev-b's round-1 update was folded: any other is a duplicate
        assert b.ack(b.send(late_blob, 1)).status == "duplicate"
        c = ManualDevice(fed.devices["dev-c"])  # online only now: not part of round 2
        late = c.ack(c.send(c.update_blob(plan1, 1, 0.25), 1))
        c.close()
        assert late.status == "late" and "round 1 is closed" in late.reason
        # forged sender (dev-b's topic, dev-a's name inside, not signed by dev-a) and garbage: counted, never folded
        forged = encode_update(Update({"fc.bias": TensorDelta((10,), np.float32([9.0]), np.array([1]))}, 5),
                               UpdateHeader("itest", 2, "dev-a", plan2.model_digest))
        env = chunk_blob(forged, Kind.UPDATE_CHUNK, "itest", "dev-a", 2, 4000)
        b.rec.link.wait_published([b.rec.link.publish(T.update_chunk("dev-b", 2, 0), env[0]),
                                   b.rec.link.publish(T.update_chunk("dev-b", 2, 1), b"\x00garbage")], 5)
        deadline = time.monotonic() + 10
        while coord.counters["bad_chunk"] + coord.counters["unsigned"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.counters["bad_chunk"] == 1 and coord.counters["unsigned"] == 1
        assert coord.counters["late"] == 1 and coord.counters["duplicate"] == 2
        assert b.ack(b.send(b.update_blob(plan2, 2, 0.1), 2)).status == "accepted"
        thread.join(60)
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        assert [r["accepted"] for r in result.history] == [2, 2]
        per_round = sum((Counter(r["rejected"]) for r in result.history), Counter())
        assert per_round == {"duplicate": 2, "late": 1, "bad_chunk": 1, "unsigned": 1}  # metrics.jsonl agrees with the counters
        assert {k: v for k, v in result.counters.items() if v} == per_round
        # folded once: the round-1 journal holds one record per device, and folding exactly those gives
        # the model round 2 was planned with
        replay = read_journal(journal_path(tmp_path / "coord/journal", 1))
        assert sorted(r.client for r in replay.updates) == ["dev-a", "dev-b"]
        strategy = coord.strategy
        agg = strategy.aggregator(initial_global_state(strategy, 0))
        for r in replay.updates:
            agg.fold(decode_update(r.data).update)
        assert model_blob(agg.result()).digest == plan2.model_digest
    finally:
        client.stop()
        b.close()
        coord.stop()


def test_restart_mid_round_replays_the_journal(tmp_path: Path, fed: FedBroker) -> None:
    kw = dict(rounds=2, quorum=2, min_devices=2, deadline_s=90.0)
    coord = _coordinator(tmp_path, fed, **kw)
    thread = coord.start()
    b, c = ManualDevice(fed.devices["dev-b"]), ManualDevice(fed.devices["dev-c"])
    try:
        plan1 = b.plan(1)
        blob_b = b.update_blob(plan1, 1, 0.5)
        db = b.send(blob_b, 1)
        assert b.ack(db).status == "accepted"
        coord.stop()
        thread.join(30)
        assert coord._thread_result is not None and coord._thread_result.stopped  # type: ignore[union-attr]
        again = _coordinator(tmp_path, fed, **kw)
        thread = again.start()
        b.rec.messages.clear()
        b.send(blob_b, 1)  # never saw the ack, say: re-sent after the restart
        assert b.ack(db).status == "duplicate"
        assert c.ack(c.send(c.update_blob(plan1, 1, -0.25), 1)).status == "accepted"
        plan2 = c.plan(2)
        for dev, v in ((b, 0.125), (c, 0.0625)):
            assert dev.ack(dev.send(dev.update_blob(plan2, 2, v), 2)).status == "accepted"
        thread.join(60)
        result = again._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        # the same four updates folded without a restart give the same model
        strategy = again.strategy
        g = initial_global_state(strategy, 0)
        for blobs in ([blob_b, c.update_blob(plan1, 1, -0.25)],):
            agg = strategy.aggregator(g)
            for blob in blobs:
                agg.fold(decode_update(blob).update)
            g = agg.result()
        assert model_blob(g).digest == plan2.model_digest
    finally:
        b.close()
        c.close()
        coord.stop()
