"""The edge client against a coordinator played by the test: it re-sends an unacknowledged update with
backoff, gives up after its retries, and a restarted device re-sends its stored upload without training
again, then settles on the ack. Plus the backoff schedule itself."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from fedtestlib import Recorder, federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.publish import Publisher, make_plan, model_blob
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.download import Pending
from edge_client.store import DeviceStore
from flayer.partition import make_partition
from flayer.engine import initial_global_state
from flayer.strategies import make_strategy
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol import Ack, Topics, decode_envelope, encode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
T = Topics("itest")


def test_backoff_schedule() -> None:
    rng = random.Random(0)
    p = Pending("update", 3, "ab" * 32, [])
    p.schedule(100.0, 30.0, 2.0, 60.0, rng)
    assert p.due == 130.0  # first send: the ack timeout alone
    waits = []
    for attempt in range(1, 8):
        p.attempt = attempt
        p.schedule(100.0, 30.0, 2.0, 60.0, rng)
        assert p.due is not None
        waits.append(p.due - 130.0)
    for attempt, w in enumerate(waits, start=1):
        base = min(60.0, 2.0 * 2 ** (attempt - 1))
        assert base <= w <= 1.5 * base  # exponential, capped, with up to 50% jitter
    assert len(set(waits)) == len(waits)


def _sends(rec: Recorder, digest: str | None = None) -> list[str]:
    """Digests of the update blobs whose first chunk arrived so far."""
    rec.drain(0.05)
    return [decode_envelope(m.payload).digest for m in rec.messages
            if m.topic == T.update_chunk("dev-a", 1, 0) and (digest is None or decode_envelope(m.payload).digest == digest)]


def _wait(pred, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def test_resend_give_up_and_resume_after_restart(tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    fb = start_fed_broker(tmp_path, "mosquitto", ["dev-a"])
    shard = client_data(digits, make_partition(digits.y, digits.num_classes, 2, "iid", 0).clients[0])
    server = Recorder(fb.coordinator, [T.all_updates()])
    clients: list[EdgeClient] = []
    try:
        cfg = load_coordinator_config(federation_toml(tmp_path / "f.toml", fb.state_dir / "credentials/coordinator.toml",
                                                      tmp_path / "coord", strategy="fedavg", rounds=1, dataset="digits"))
        model = model_blob(initial_global_state(make_strategy("fedavg", cfg.spec, cfg.run.train, {}), 0))
        pub = Publisher(server.link, T, "coordinator", fb.coordinator.max_payload, tmp_path, 30, lambda: False,
                        key=fb.coordinator.signer())
        chunks, _ = pub.model(model, 1)
        pub.plan(make_plan(cfg, "fedavg", {}, 1, ["dev-a"], time.time() + 300, model, chunks))
        settings = EdgeSettings(state_dir=str(tmp_path / "dev-a"), client_index=0, device="cpu", heartbeat_s=2.0,
                                ack_timeout_s=1.0, backoff_s=0.2, backoff_max_s=0.5, retries=2)
        first = EdgeClient(settings, fb.devices["dev-a"], shard)
        clients.append(first)
        first.start()
        assert _wait(lambda: len(_sends(server)) >= 3), "expected the first send and two re-sends"
        digest = _sends(server)[0]
        assert set(_sends(server)) == {digest}  # the same bytes every time
        assert first.rounds_trained == [1]
        assert _wait(lambda: DeviceStore(settings.state_dir).load().upload.status == "gave_up")  # type: ignore[union-attr]
        first.stop()
        assert first.wait(10)
        # a restarted device with a pending upload re-sends it without training again
        store = DeviceStore(settings.state_dir)
        stored = store.load()
        assert stored.upload is not None and stored.done_round == 1
        store.save(type(stored)(stored.state, stored.done_round,
                                type(stored.upload)(stored.upload.round, stored.upload.digest, stored.upload.size),
                                False, stored.extra))  # as if it had crashed before giving up
        before = len(_sends(server))
        second = EdgeClient(settings, fb.devices["dev-a"], shard)
        clients.append(second)
        second.start()
        assert _wait(lambda: len(_sends(server)) > before), "the restarted device did not re-send"
        assert set(_sends(server)) == {digest} and second.rounds_trained == []
        ack = encode_message(Ack(1, "dev-a", digest, "accepted"), "itest", "coordinator", key=fb.coordinator.signer())
        server.link.wait_published([server.link.publish(T.ack("dev-a"), ack)], 5)
        assert _wait(lambda: DeviceStore(settings.state_dir).load().upload.status == "accepted")  # type: ignore[union-attr]
    finally:
        for c in clients:
            c.stop()
        server.close()
        fb.broker.stop()
