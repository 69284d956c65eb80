"""Models over HTTP end to end: a live Mosquitto, the real coordinator writing its model files into a
folder that a real nginx serves, real edge clients. The devices download every model over HTTP (and
take no model chunk from the broker) and end with the very models of the same federation run over the
broker only, bit for bit; a model file corrupted on the web server is refused by its digest and that
model taken from the broker's chunks instead."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fedtestlib import FedBroker, federation_toml, finished, iid_shards

from coordinator.config import load_coordinator_config
from coordinator.model_files import ModelFiles
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from emulator.setup import clear_round_plan
from transport.wirecount import count_wire_bytes

pytestmark = [pytest.mark.integration]
DEVICES = ["dev-a", "dev-b"]
ROUNDS = 2


@pytest.fixture
def fed(fed_broker):  # type: ignore[no-untyped-def]
    return fed_broker(DEVICES)


@pytest.fixture(scope="module")
def shards(digits):  # type: ignore[no-untyped-def]
    return iid_shards(digits, 2)


class CorruptFirstFile(ModelFiles):
    """Writes the first model's file with one byte flipped (a damaged copy on the web server)."""

    corrupted = False

    def write(self, digest: str, blob: bytes) -> bool:
        if not self.corrupted:
            self.corrupted, blob = True, blob[:-1] + bytes([blob[-1] ^ 0xFF])
        return super().write(digest, blob)


def _run(tmp: Path, fb: FedBroker, shards: list, name: str, models_url: str = "",
         files: type[ModelFiles] | None = None) -> tuple[Any, dict[str, list], dict[str, Counter]]:
    extra = {"models_dir": str(tmp / "models"), "models_url": models_url} if models_url else {}
    path = federation_toml(tmp / f"{name}.toml", fb.state_dir / "credentials/coordinator.toml", tmp / name,
                           strategy="fedavg", rounds=ROUNDS, dataset="digits", quorum=2, min_devices=2, **extra)
    cfg = load_coordinator_config(path)
    clear_round_plan(fb.coordinator)  # the broker's retained final plan of the run before would end the devices
    coord = Coordinator(cfg, fb.coordinator)
    if files is not None:
        coord.publishing.publisher.files = files(tmp / "models")
    events: dict[str, list[tuple[str, dict]]] = {d: [] for d in DEVICES}
    wire: dict[str, Counter] = {d: Counter() for d in DEVICES}
    lock = threading.Lock()
    clients = []
    for i, d in enumerate(DEVICES):
        def record(kind: str, info: dict, d: str = d) -> None:
            with lock:
                events[d].append((kind, dict(info)))
        settings = EdgeSettings(state_dir=str(tmp / name / d), client_index=i, device="cpu", heartbeat_s=1.0,
                                download_stall_s=1.0, threads=1)
        client = EdgeClient(settings, fb.devices[d], shards[i], on_progress=record)
        count_wire_bytes(client.link.client, lambda n, way, d=d: wire[d].update({way: n}))  # way: up | down
        clients.append(client)
    thread = coord.start()
    for c in clients:
        c.start()
    try:
        result = finished(coord, thread, 120, ROUNDS)
        for c in clients:
            assert c.wait(60) and c.error is None and c.rounds_trained == list(range(1, ROUNDS + 1))
            held = c._held.load(c.limits)  # the final model on disk (an idle client keeps none in memory)
            assert held is not None and held[0] == result.model_digest
    finally:
        for c in clients:
            c.stop()
    return result, events, wire


def _downloads(evs: list) -> list[dict]:
    return [info for kind, info in evs if kind == "downloaded"]


def test_devices_fetching_models_over_http_hold_the_broker_only_runs_models(tmp_path: Path, fed: FedBroker,
                                                                           shards: list, nginx: Any) -> None:
    base, base_events, base_wire = _run(tmp_path, fed, shards, "broker-only")
    http, http_events, http_wire = _run(tmp_path, fed, shards, "http", nginx.url)
    assert http.model_digest == base.model_digest  # the same final model, bit for bit
    for d in DEVICES:
        assert [i["digest"] for i in _downloads(http_events[d])] == [i["digest"] for i in _downloads(base_events[d])]
        assert all(i.get("via") == "http" for i in _downloads(http_events[d]))
        assert all("via" not in i for i in _downloads(base_events[d]))
        model_bytes = sum(i["http_bytes"] for i in _downloads(http_events[d]))
        # over the broker the device received the models; with HTTP, only control messages and acks
        assert base_wire[d]["down"] > model_bytes > 10 * http_wire[d]["down"], (base_wire[d], http_wire[d], model_bytes)
        print(f"{d}: MQTT bytes in, broker only {base_wire[d]['down']}, with HTTP {http_wire[d]['down']}; "
              f"over HTTP {model_bytes}")
    served = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert served == [http.model_digest]  # the final model's file; the older ones pruned with their chunks


def test_a_corrupted_model_file_is_refused_and_the_brokers_chunks_taken(tmp_path: Path, fed: FedBroker,
                                                                        shards: list, nginx: Any) -> None:
    base, _, _ = _run(tmp_path, fed, shards, "broker-only")
    http, http_events, _ = _run(tmp_path, fed, shards, "http", nginx.url, CorruptFirstFile)
    assert http.model_digest == base.model_digest
    for d in DEVICES:
        kinds = [(k, i.get("failure"), i.get("via")) for k, i in http_events[d] if k in ("downloaded", "http_fallback")]
        assert kinds[:2] == [("http_fallback", "digest", None), ("downloaded", None, None)], kinds  # from the chunks
        assert all(k == ("downloaded", None, "http") for k in kinds[2:]) and len(kinds) == ROUNDS + 2, kinds
