"""A private fleet that grows and re-keys with no file copied between devices (docs/tutorials/across-machines.md).

Over TLS, with local differential privacy and secure aggregation: four devices are added one after another, each
kit made after the devices before it started (so no kit knows the devices after it), and every device runs from its
own unpacked kit in its own folder (its own "machine"). After the first secure round, dev-2 is re-keyed with
``flayer broker rekey dev-2 --kit`` onto its own kit file and restarted from the new kit in the same folder: its
state (ledger, personal model) is kept, the others learn its new key from its certificate and refuse the old one
from the authority's revocation list, and every secure round unmasks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import federation_toml, finished, wait_connectable

from cli.main import main as cli
from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import BrokerConfig, load_credentials, mosquitto_available, start_broker
from transport.credentials import Credentials
from transport.kit import unpack_kit

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
DEVICES = [f"dev-{i}" for i in range(4)]
ROUNDS = 3


def _edge(kit_dir: Path, shard: Any) -> EdgeClient:
    creds = Credentials.load(kit_dir / "credentials.toml")
    settings = EdgeSettings(state_dir=str(kit_dir / "state"), device="cpu", heartbeat_s=2.0, ack_timeout_s=10.0,
                            threads=1)
    client = EdgeClient(settings, creds, shard)
    client.start()
    return client


@pytest.mark.timeout(600)
def test_four_devices_added_one_by_one_and_one_rekeyed_unmask_every_secure_round(tmp_path: Path, digits: Any,
                                                                                 caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="coordinator")
    part = make_partition(digits.y, digits.num_classes, 4, "iid", seed=0, samples=400)
    shards = [client_data(digits, c) for c in part.clients]
    state = tmp_path / "broker"
    broker = start_broker(BrokerConfig(federation="fleet", tls=True, require_certificate=True), state,
                          kind="mosquitto", timeout=30)
    edges: dict[str, EdgeClient] = {}
    kits: dict[str, Path] = {}
    try:
        fed = federation_toml(tmp_path / "federation.toml", state / "credentials/coordinator.toml",
                              tmp_path / "coord", strategy="fedavg", rounds=ROUNDS, dataset="digits", quorum=4,
                              min_devices=4, deadline_s=120.0)
        fed.write_text(fed.read_text() + "[privacy]\nenabled = true\nmode = \"local\"\nclip = 1.0\n"
                       "noise_multiplier = 0.5\npopulation = 4\nsecure_aggregation = true\nsecure_stage_s = 20.0\n")
        for i, dev in enumerate(DEVICES):  # one by one: each kit made after the devices before it started
            machine = tmp_path / f"machine-{dev}"
            assert cli(["broker", "add-device", dev, "--state-dir", str(state), "--kit",
                        str(machine / f"{dev}.tar.gz")]) == 0
            kits[dev] = unpack_kit(machine / f"{dev}.tar.gz").parent
            assert not (kits[dev] / "signing_keys.json").exists()  # nothing but its own certificate
            wait_connectable(Credentials.load(kits[dev] / "credentials.toml"))
            edges[dev] = _edge(kits[dev], shards[i])
        coord = Coordinator(load_coordinator_config(fed), load_credentials(state, "coordinator"))
        thread = coord.start()
        deadline = time.monotonic() + 240
        while not edges["dev-2"].rounds_trained and time.monotonic() < deadline:
            time.sleep(0.2)
        assert edges["dev-2"].rounds_trained, "no first round"
        old_key = edges["dev-2"].signer.public
        assert cli(["broker", "rekey", "dev-2", "--state-dir", str(state), "--kit",
                    str(tmp_path / "machine-dev-2" / "dev-2.tar.gz")]) == 0
        edges["dev-2"].stop()
        assert unpack_kit(tmp_path / "machine-dev-2" / "dev-2.tar.gz").parent == kits["dev-2"]  # the same folder
        restarted = _edge(kits["dev-2"], shards[2])
        assert restarted.signer.public != old_key
        assert restarted.stored.done_round >= 1 or restarted.store.plan_round() >= 1  # its state was kept
        edges["dev-2"] = restarted
        result = finished(coord, thread, 400, rounds=ROUNDS)
        assert result is not None
        said = [r.getMessage() for r in caplog.records]
        unmasked = [m for m in said if "secure round unmasked" in m]
        assert len(unmasked) >= ROUNDS, said[-40:]
        for dev, edge in edges.items():
            assert edge.error is None, (dev, edge.error)
    finally:
        for edge in edges.values():
            edge.stop()
        broker.stop()
