"""Announced uploads on a live Mosquitto with the real coordinator and edge clients: a device on a
1 Mbit/s uplink, whose upload takes seconds after two fast devices made the quorum, has its update
accepted (the round waits for the upload it announced) instead of refused as late. A device that
announces and vanishes: tests/attacks/test_attack_announce_hold.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fedtestlib import FedBroker, federation_toml, finished, iid_shards

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DEVICES = ["dev-a", "dev-b", "dev-slow"]


@pytest.fixture
def fed(fed_broker):  # type: ignore[no-untyped-def]
    return fed_broker(DEVICES)


@pytest.fixture(scope="module")
def shards(digits):  # type: ignore[no-untyped-def]
    return iid_shards(digits, 3)


def clients_for(tmp: Path, fed: FedBroker, shards: list, events: dict[str, list], up_mbps: float) -> list[EdgeClient]:
    from emulator.profiles import DeviceProfile
    from emulator.shaping import LinkShaper

    lock = threading.Lock()
    clients = []
    for i, d in enumerate(DEVICES):
        def record(kind: str, info: dict, d: str = d) -> None:
            with lock:
                events[d].append((kind, dict(info)))
        settings = EdgeSettings(state_dir=str(tmp / d), client_index=i, device="cpu", heartbeat_s=1.0, threads=1)
        shaper = LinkShaper(DeviceProfile("thin", up_mbps=up_mbps)) if d == "dev-slow" else None
        clients.append(EdgeClient(settings, fed.devices[d], shards[i], shaper=shaper, on_progress=record))
    return clients


def test_a_slow_uplink_device_is_accepted_not_refused_as_late(tmp_path: Path, fed: FedBroker, shards: list) -> None:
    """digits' CNN uploads 363 kB in fp32: about 3 s at 1 Mbit/s. Two fast devices make the quorum of 2
    and the round's 0.5 s grace ends long before the slow upload is in; without the wait for announced
    uploads every one of the slow device's updates is refused ``late``."""
    path = federation_toml(tmp_path / "federation.toml", fed.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=2, dataset="digits", quorum=2,
                           min_devices=3, over_selection=1.5, grace_s=0.5)  # announce_wait_s: the default
    coord = Coordinator(load_coordinator_config(path), fed.coordinator)
    events: dict[str, list[tuple[str, dict]]] = {d: [] for d in DEVICES}
    clients = clients_for(tmp_path, fed, shards, events, up_mbps=1.0)
    thread = coord.start()
    for c in clients:
        c.start()
    try:
        result = finished(coord, thread, 150, 2)
        for c in clients:
            assert c.wait(60) and c.error is None
    finally:
        for c in clients:
            c.stop()
    acks = [(i["round"], i["status"]) for k, i in events["dev-slow"] if k == "ack"]
    assert acks == [(1, "accepted"), (2, "accepted")], acks
    assert [r["accepted"] for r in result.history] == [3, 3], [(r["accepted"], r["closed"]) for r in result.history]
    assert all(r["wall_s"] < 40 for r in result.history)  # quorum + grace + the 10 s bound, not the 60 s deadline
