"""Secure-aggregation pieces of the attack harness: a private secure federation of real edge clients, each run from
its kit, on a real broker; and the stages of an in-process round that a lying coordinator runs honestly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fedtestlib import FedBroker, device_toml, federation_toml, finished, start_fed_broker

from flayer.secagg import KeyAdvert, SecAggClient, SecAggServer


def private_secure_federation(tmp: Path, fb: FedBroker, devices: int, rounds: int, stage_s: float) -> Path:
    """``tmp / "federation.toml"``: ``rounds`` FLAYER rounds of digits over ``fb``, every one of ``devices`` needed
    (quorum and minimum), each round a secure one (``stage_s`` a stage) with distributed DP (local noise, every
    device's ledger counting it)."""
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="flayer", rounds=rounds, dataset="digits", seed=0, lr=0.05, quorum=devices,
                          min_devices=devices, deadline_s=120.0)
    fed.write_text(fed.read_text() + f'[privacy]\nsecure_aggregation = true\nsecure_stage_s = {stage_s}\n'
                                     'enabled = true\nmode = "local"\nclip = 0.5\nnoise_multiplier = 1.0\n'
                                     'population = 40\n')
    return fed


def private_secure_rounds(tmp: Path, fb: FedBroker, devices: int, rounds: int, stage_s: float,
                          timeout: float) -> list[dict[str, Any]]:
    """A real coordinator over ``fb`` run to its end (within ``timeout`` seconds) on
    :func:`private_secure_federation`; the round records of its metrics, in order."""
    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from protocol.metrics_schema import read_metrics

    fed = private_secure_federation(tmp, fb, devices, rounds, stage_s)
    coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
    finished(coord, coord.start(), timeout, rounds=rounds)
    return [r for r in read_metrics(tmp / "coord/metrics.jsonl") if r["kind"] == "round"]


@contextmanager
def kit_fleet(tmp: Path, digits: Any, names: list[str], privacy: str = "", others: Sequence[str] = ()
              ) -> Iterator[tuple[FedBroker, list[Any]]]:
    """A real broker (Mosquitto where installed) with the accounts of ``names``, and a started, connected edge
    client for each, run from its kit (its certificate, the pinned authority key) on a dir0.5 shard of ``digits``
    (``privacy``: the body of each device.toml's ``[privacy]`` table); ``others``: device accounts beside them that
    run no edge client (an adversary's own device); the clients and the broker are stopped on leaving."""
    from edge_client.client import EdgeClient
    from edge_client.config import load_device_config
    from flayer.partition import make_partition, save_partition
    from flayer.train import client_data
    from mqtt_broker import mosquitto_available
    from mqtt_broker.kit import write_kit
    from transport.credentials import Credentials
    from transport.kit import unpack_kit

    fb = start_fed_broker(tmp, "mosquitto" if mosquitto_available() else "embedded", [*names, *others])
    devices: list[EdgeClient] = []
    try:
        part = make_partition(digits.y, digits.num_classes, len(names), "dir0.5", seed=0, samples=400,
                              meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
        pfile = save_partition(part, tmp / "digits.npz")
        for i, name in enumerate(names):
            kit = unpack_kit(write_kit(fb.state_dir, name, tmp / f"machine-{name}" / f"{name}.tar.gz")).parent
            path = device_toml(tmp / f"{name}.toml", kit / "credentials.toml", dataset="digits", partition_file=pfile,
                               client=i, state_dir=tmp / name)
            if privacy:
                path.write_text(path.read_text() + f"[privacy]\n{privacy}\n")
            devices.append(EdgeClient(load_device_config(path).edge, Credentials.load(kit / "credentials.toml"),
                                      client_data(digits, part.clients[i])))
        for dev in devices:
            dev.start()
        for dev in devices:
            assert dev.link.connected.wait(60)
        yield fb, devices
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()


def honest_to_masked(server: SecAggServer, clients: dict[str, SecAggClient], inputs: dict[str, np.ndarray]
                     ) -> tuple[dict[str, KeyAdvert], dict[str, np.ndarray]]:
    """The stages a lying coordinator runs honestly, through ``server``: every client's key advert, its shares, then
    its masked input of ``inputs[d]``; the adverts and the masked vectors, as the coordinator holds them."""
    adverts = {d: c.advertise() for d, c in clients.items()}
    for advert in adverts.values():
        server.receive_advert(advert)
    for d, c in clients.items():
        server.receive_shares(c.share_keys(server.key_bundle(d)))
    masked = {}
    for d, c in clients.items():
        msg = c.masked_input(server.shares_for(d), inputs[d])
        server.receive_masked(msg)
        masked[d] = msg.vector
    return adverts, masked
