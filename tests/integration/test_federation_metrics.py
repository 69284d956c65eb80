"""The coordinator's Prometheus endpoint on a live Mosquitto with the real coordinator and edge client classes:
served while the rounds run (device labels included), and after the run the registry it renders holds the
rounds of metrics.jsonl and the coordinator's refusal counters (junk sent by a device outside the plan)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import Recorder, federation_toml, finished, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.exporter import REFUSAL_REASONS
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol import Topics

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
DEVICES = ["dev-a", "dev-b", "junk"]
T = Topics("itest")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return resp.read().decode()


def test_the_endpoint_agrees_with_metrics_jsonl_and_the_counters(tmp_path: Path, digits: Any) -> None:
    fb = start_fed_broker(tmp_path, "mosquitto", DEVICES)
    part = make_partition(digits.y, digits.num_classes, 2, "iid", 0)
    path = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=3, dataset="digits", quorum=2, min_devices=2,
                           metrics_port=0)
    coord = Coordinator(load_coordinator_config(path), fb.coordinator)
    edges = [EdgeClient(EdgeSettings(state_dir=str(tmp_path / d), client_index=i, device="cpu", heartbeat_s=1.0,
                                     label="board-a"), fb.devices[d], client_data(digits, part.clients[i]))
             for i, d in enumerate(DEVICES[:2])]
    junk = Recorder(fb.devices["junk"])
    thread = coord.start()
    try:
        for e in edges:
            e.start()
        deadline = time.monotonic() + 60
        while coord.endpoint.server is None or coord.open is None:
            assert time.monotonic() < deadline, "round 1 did not open"
            time.sleep(0.05)
        url = coord.endpoint.server.url
        assert url.startswith("http://127.0.0.1:")  # loopback by default, no token
        sent = [junk.link.publish(T.update_chunk("junk", 1, i), b"junk") for i in range(2)]
        sent.append(junk.link.publish(T.status("junk"), b"not a status"))
        assert junk.link.wait_published(sent, 10.0)
        while "flayer_open_round 1.0" not in (live := _scrape(url)):  # synced as soon as the round opened
            assert time.monotonic() < deadline, live
            time.sleep(0.05)
        assert 'flayer_info{federation="itest",mode="sync",strategy="fedavg"} 1.0' in live
        assert 'flayer_devices_selected{label="board-a"} 2.0' in live and "flayer_norm_bound +Inf" not in live
        result = finished(coord, thread, 120, rounds=3)
    finally:
        junk.close()
        for e in edges:
            e.stop()
        coord.stop()
        fb.broker.stop()
    lines = [json.loads(x) for x in (tmp_path / "coord" / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if x["kind"] == "round"]
    reg = coord.exporter.registry

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, labels)

    assert value("flayer_rounds_total") == len(rounds) == 3
    assert value("flayer_updates_accepted_total") == sum(r["accepted"] for r in rounds) == 6
    assert value("flayer_bytes_down_total") == sum(r["bytes_down"] for r in rounds) > 0
    assert value("flayer_round_duration_seconds_sum") == pytest.approx(sum(r["wall_s"] for r in rounds), abs=0.01)
    refused = {r: value("flayer_updates_refused_total", reason=r) for r in REFUSAL_REASONS}
    assert {k: v for k, v in refused.items() if v} == {k: float(v) for k, v in result.counters.items() if v}
    assert result.counters["bad_chunk"] == 2 and result.counters["bad_message"] == 1
    assert lines[-1]["kind"] == "end" and lines[-1]["counters"] == result.counters
    assert value("flayer_devices_online", label="board-a") == 2  # synced once more at the end
    assert value("flayer_last_round_devices", result="accepted") == 2
    assert coord.endpoint.server is None  # closed with the run
