"""Revocation mid-run: after round 1 the operator revokes dev-3 ('flayer broker revoke'); the broker
closes its connection and refuses it (so it can neither connect nor publish), the coordinator stops
selecting it, and the two other devices finish the federation."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from fedtestlib import start_fed_broker
from fleetlib import federation_toml, write_images

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.sources import DeviceSource, SourceConfig
from mqtt_broker import mosquitto_available
from protocol.metrics_schema import read_metrics
from transport.credentials import mqtt_connect_settings
from transport.link import probe

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
DEVICES = ["dev-1", "dev-2", "dev-3"]


def test_a_revoked_device_is_shut_out_and_the_others_finish(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from cli.main import main

    fb = start_fed_broker(tmp_path, "mosquitto", DEVICES, federation="pets")
    clients: list[EdgeClient] = []
    revoked = threading.Event()
    try:
        fed = federation_toml(tmp_path / "coord", fb.state_dir / "credentials/coordinator.toml", rounds=3,
                              devices=2, strategy="fedavg", over_selection=1.5)  # all online selected, 2 close
        cfg = load_coordinator_config(fed)
        first_round, revoked = threading.Event(), threading.Event()

        def on_round(rec: dict[str, object]) -> None:  # hold the federation after round 1 until dev-3 is revoked
            if rec["round"] == 1:
                first_round.set()
                revoked.wait(60)

        coord = Coordinator(cfg, fb.coordinator, on_round=on_round)
        thread = coord.start()
        for i, dev in enumerate(DEVICES):
            images = write_images(tmp_path / dev / "images", {"cat": 6, "dog": 6, "owl": 6}, 8, seed=i)
            settings = EdgeSettings(state_dir=str(tmp_path / dev / "state"), device="cpu", threads=1, heartbeat_s=1.0,
                                    ack_timeout_s=10.0, allow_entry_points=("fleetmodel:build",))
            clients.append(EdgeClient(settings, fb.devices[dev], DeviceSource(SourceConfig("folder", str(images)))))
            clients[-1].start()
        assert first_round.wait(120), "round 1 did not close"
        assert main(["broker", "revoke", "dev-3", "--state-dir", str(fb.state_dir)]) == 0
        out = capsys.readouterr().out
        assert "revoked device dev-3" in out and "password" not in out.split("revoked device")[0]
        fb.broker.reload()  # the test's broker is not a recorded background one: reload it as the CLI does
        assert clients[2].wait(60), "dev-3 kept running after its revocation"
        assert "refused" in str(clients[2].error), clients[2].error
        old = fb.devices["dev-3"]
        ev = probe(mqtt_connect_settings(old))
        assert ev is not None and not ev.ok  # cannot connect, hence cannot publish
        revoked.set()
        thread.join(240)
        result = coord._thread_result
        assert not isinstance(result, BaseException), result
        assert result is not None and result.finished and result.rounds_done == 3
        for c in clients[:2]:
            assert c.wait(60) and c.error is None, c.error
        rounds = [r for r in read_metrics(tmp_path / "coord/state/metrics.jsonl") if r["kind"] == "round"]
        assert all("dev-3" not in r["selected"] and r["accepted"] == 2 for r in rounds[1:]), rounds
        assert json.loads((fb.state_dir / "revoked.json").read_text()).keys() == {"dev-3"}
        assert not (fb.state_dir / "credentials/dev-3.toml").exists()
    finally:
        revoked.set()
        for c in clients:
            c.stop()
        fb.broker.stop()
