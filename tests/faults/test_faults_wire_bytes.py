"""Byte counts include every byte a device moves: its socket-level count (transport.wirecount, what the
emulator's mb_up / mb_down add up) equals what a TCP proxy in front of the broker forwarded, over a
link cut mid-download and the reconnect -- re-deliveries and re-sends included; the coordinator's
round record counts its own connection the same way."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from faultlib import start_persistent_broker, wait_until
from fedtestlib import federation_toml
from tcpproxy import CutProxy

from coordinator.config import load_coordinator_config
from coordinator.publish import model_blob
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.engine import initial_global_state
from mqtt_broker import mosquitto_available
from transport.wirecount import WireBytes, count_wire_bytes

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]


def test_wire_counts_match_the_proxy_across_a_cut(tmp_path: Path, digits_shards: list) -> None:
    fb = start_persistent_broker(tmp_path, ["dev-0"], max_packet_size=16384)
    proxy = CutProxy(fb.broker.port)
    path = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=1, dataset="digits", deadline_s=120.0)
    coord = Coordinator(load_coordinator_config(path), fb.coordinator)
    model = model_blob(initial_global_state(coord.strategy, 0))
    events: list[tuple[str, dict[str, Any]]] = []
    # the device stays connected after the final plan: a device that exits leaves what the broker had
    # already sent it (chunks queued before its unsubscribe) unread in its socket, forwarded but never counted
    settings = EdgeSettings(state_dir=str(tmp_path / "dev-0"), device="cpu", heartbeat_s=1.0, ack_timeout_s=10.0,
                            download_stall_s=60.0, exit_when_finished=False)
    device = EdgeClient(settings, dataclasses.replace(fb.devices["dev-0"], port=proxy.port), digits_shards[0],
                        on_progress=lambda kind, info: events.append((kind, info)))
    wire = WireBytes()
    count_wire_bytes(device.link.client, wire.add)
    thread = coord.start()
    try:
        proxy.cut_after(model.size * 2 // 3)
        device.start()
        wait_until(proxy.cut.is_set, 60, "the cut")
        thread.join(120)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished, result
        wait_until(lambda: device.finished or device.error is not None, 30, "the device's final save")
        assert device.error is None and device.rounds_trained == [1]
        assert len(proxy.conns) >= 2, "the device did not reconnect"
        stats = [info for kind, info in events if kind == "downloaded"][0]
        assert stats["repeated"] >= 1  # chunks came twice (before the cut, and re-delivered after it)
        # every byte the proxy forwarded to the device, on every connection, is in the device's count
        wait_until(lambda: wire.snapshot()[1] == proxy.down_bytes(), 10,
                   f"down counts to agree ({wire.snapshot()[1]} counted, {proxy.down_bytes()} forwarded)")
        # the device sent at least what reached the broker (after the cut the proxy drops what it sends)
        assert wire.snapshot()[0] >= sum(c.up for c in proxy.conns) > 0
        assert wire.snapshot()[1] > model.size and wire.snapshot()[0] > result.history[0]["bytes_in"]
        rec = result.history[0]
        # the coordinator's record: its whole connection, at least the payloads it counts separately
        assert rec["bytes_up"] >= rec["bytes_in"] > 0 and rec["bytes_down"] >= rec["bytes_out"] > 0
    finally:
        device.stop()
        coord.stop()
        proxy.close()
        fb.broker.stop()
