"""A device's link cut mid-download (a TCP proxy between it and Mosquitto drops the connection after
two thirds of the model went through): the device reconnects and resumes from the retained chunks -- it gets
only what it was missing, not the whole model again -- and completes with the right digest."""

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

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]


def test_link_cut_mid_download_resumes_from_the_retained_chunks(
    tmp_path: Path, digits_shards: list, faults_ledger: Any
) -> None:
    fb = start_persistent_broker(tmp_path, ["dev-0"], max_packet_size=16384)
    proxy = CutProxy(fb.broker.port)
    path = federation_toml(
        tmp_path / "federation.toml",
        fb.state_dir / "credentials/coordinator.toml",
        tmp_path / "coord",
        strategy="fedavg",
        rounds=1,
        dataset="digits",
        deadline_s=120.0,
    )
    coord = Coordinator(load_coordinator_config(path), fb.coordinator)
    model = model_blob(initial_global_state(coord.strategy, 0))
    events: list[tuple[str, dict[str, Any]]] = []
    settings = EdgeSettings(
        state_dir=str(tmp_path / "dev-0"),
        client_index=0,
        device="cpu",
        heartbeat_s=1.0,
        ack_timeout_s=10.0,
        download_stall_s=60.0,
    )
    device = EdgeClient(
        settings,
        dataclasses.replace(fb.devices["dev-0"], port=proxy.port),
        digits_shards[0],
        on_progress=lambda kind, info: events.append((kind, info)),
    )
    thread = coord.start()
    try:
        proxy.cut_after(model.size * 2 // 3)  # the device's first connection dies 2/3 through the model
        device.start()
        wait_until(proxy.cut.is_set, 60, "the cut")
        thread.join(120)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished, result
        assert device.wait(30) and device.error is None and device.rounds_trained == [1]
        assert (
            result.history[0]["accepted"] == 1
        )  # its update names the model's digest: it had the right model
        assert len(proxy.conns) >= 2, "the device did not reconnect"
        first = f"fl/{fb.coordinator.federation}/model/{model.digest}/"
        held = {t for t, _, _ in proxy.published(0) if t.startswith(first)}  # whole chunks before the cut
        again = [
            (t, dup)
            for c in range(1, len(proxy.conns))
            for t, _, dup in proxy.published(c)
            if t.startswith(first)
        ]
        stats = [info for kind, info in events if kind == "downloaded"]
        assert stats and stats[0]["digest"] == model.digest and stats[0]["resumes"] == 1, stats
        s = stats[0]
        print(
            f"model {model.size} B in {s['chunks']} chunks; the device held {len(held)} at the cut; after it "
            f"{len(again)} came ({sum(d for _, d in again)} re-deliveries of what the broker had in flight), "
            f"{s['repeated']} of them held already"
        )
        assert s["held_at_resume"] == len(held) >= 8
        # proved: after the reconnect every chunk came at most once, and none the device held came as a
        # new delivery (as a fresh subscription would bring every retained chunk again); the only repeats
        # are the broker re-delivering (DUP) what was in flight when the link died, as QoS 1 requires
        assert len(again) == len({t for t, _ in again}) <= s["chunks"]
        assert not {t for t, dup in again if not dup} & held
        assert s["repeated"] == len(held & {t for t, _ in again})
        assert s["received"] == len(held) + len(again) and s["received"] - s["repeated"] == s["chunks"]
        faults_ledger.fault("link cut mid-download (TCP proxy)", 1, True, 1, result.history[0]["accepted"])
    finally:
        device.stop()
        coord.stop()
        proxy.close()
        fb.broker.stop()
