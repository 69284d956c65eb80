"""The edge client against a coordinator played by the test, for faults on the device's side of the
protocol: an ack that arrives while the device is still publishing the update it answers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from faultlib import FEDERATION, start_persistent_broker, wait_until
from fedtestlib import Recorder, federation_toml

from coordinator.config import load_coordinator_config
from coordinator.publish import Publisher, make_plan, model_blob
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore
from flayer.engine import initial_global_state
from flayer.strategies import make_strategy
from mqtt_broker import mosquitto_available
from protocol import Ack, Topics, decode_envelope, encode_message

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
T = Topics(FEDERATION)


def test_an_ack_that_overtakes_the_upload_is_not_lost(
    tmp_path: Path, digits_shards: list, faults_ledger: Any
) -> None:
    """The coordinator can fold an update and ack it before the device's publishing job has reported
    back (its PUBACKs still on the way). Here the device's uplink is slow (the client's link shaper:
    0.1 s per chunk) and the ack is sent as soon as the first of the update's 24 chunks arrives, so it
    always arrives while the device is still publishing: the device must settle on it, not wait for
    its ack timeout and send the whole update again."""
    fb = start_persistent_broker(tmp_path, ["dev-a"], max_packet_size=16384)
    server = Recorder(fb.coordinator, [T.all_updates()])
    device: EdgeClient | None = None
    try:
        cfg = load_coordinator_config(
            federation_toml(
                tmp_path / "f.toml",
                fb.state_dir / "credentials/coordinator.toml",
                tmp_path / "coord",
                strategy="fedavg",
                rounds=1,
                dataset="digits",
            )
        )
        model = model_blob(initial_global_state(make_strategy("fedavg", cfg.spec, cfg.run.train, {}), 0))
        pub = Publisher(
            server.link, T, "coordinator", fb.coordinator.max_payload, tmp_path, 30, lambda: False,
            key=fb.coordinator.signer(),
        )
        chunks, _ = pub.model(model, 1)
        pub.plan(make_plan(cfg, "fedavg", {}, 1, ["dev-a"], time.time() + 300, model, chunks))
        settings = EdgeSettings(
            state_dir=str(tmp_path / "dev-a"),
            client_index=0,
            device="cpu",
            heartbeat_s=1.0,
            ack_timeout_s=2.0,  # one that missed the ack re-sends 2 s after its publish (the sleep below)
            backoff_s=0.5,
            retries=3,
        )
        device = EdgeClient(
            settings,
            fb.devices["dev-a"],
            digits_shards[0],
            shaper=lambda nbytes, direction: 0.1 if direction == "up" and nbytes > 10_000 else 0.0,
        )
        device.start()
        first = wait_until(
            lambda: next((m for m in server.drain(0.02) if m.topic == T.update_chunk("dev-a", 1, 0)), None),
            60,
            "the update's first chunk",
        )
        env = decode_envelope(first.payload)
        assert env.count > 10  # the device is still publishing the rest
        ack = encode_message(Ack(1, "dev-a", env.digest, "accepted"), FEDERATION, "coordinator",
                             key=fb.coordinator.signer())
        server.link.wait_published([server.link.publish(T.ack("dev-a"), ack)], 5)
        store = DeviceStore(settings.state_dir)
        wait_until(
            lambda: getattr(store.load().upload, "status", "pending") != "pending",
            20,
            "the device to settle its upload",
        )
        assert store.load().upload.status == "accepted"  # type: ignore[union-attr]
        time.sleep(settings.ack_timeout_s + 1.5)  # a device that missed the ack re-sends by now
        sends = [m for m in server.drain(0.1) if m.topic == T.update_chunk("dev-a", 1, 0)]
        assert len(sends) == 1, f"the update was sent {len(sends)} times"
        faults_ledger.fault("ack overtaking the device's publish", 1, True, 1, 1)
    finally:
        if device is not None:
            device.stop()
        server.close()
        fb.broker.stop()
