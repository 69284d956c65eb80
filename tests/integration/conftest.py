"""Federation fixtures: a Fashion-MNIST partition shared by the round tests, and the in-process
simulator's result for it (the reference the MQTT runs must reproduce)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass
class FmnistRun:
    dataset: Any
    partition: Any
    partition_file: Path
    clients: list[Any]
    strategy: str
    rounds: int
    seed: int
    lr: float
    reference: dict[str, Any]  # simulate()'s final global state

    @property
    def devices(self) -> list[str]:
        """One device per client of the partition: dev-0, dev-1, ..."""
        return [f"dev-{i}" for i in range(len(self.clients))]


@pytest.fixture(scope="session")
def fmnist_run(tmp_path_factory: pytest.TempPathFactory) -> FmnistRun:
    if not (FMNIST_DIR / "train-labels-idx1-ubyte.gz").exists() and not (FMNIST_DIR / "train-labels-idx1-ubyte").exists():
        pytest.skip("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist)")
    from fedtestlib import strategy_under_test

    from coordinator.config import model_spec_for
    from flayer.config import TrainConfig
    from flayer.data import load_dataset
    from flayer.partition import make_partition, save_partition
    from flayer.simulation import simulate
    from flayer.strategies import make_strategy
    from flayer.train import client_data

    ds = load_dataset("fmnist")
    # three devices: each is a process in the Mosquitto test, and a process's start (torch) costs more CPU
    # than its three rounds of training
    part = make_partition(ds.y, ds.num_classes, 3, "dir0.5", seed=0, samples=1000,
                          meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()})
    path = save_partition(part, tmp_path_factory.mktemp("partition") / "fmnist-3.npz")
    clients = [client_data(ds, c) for c in part.clients]
    name, rounds, seed, lr = strategy_under_test(), 3, 0, 0.05
    assert model_spec_for("fmnist") == ds.model_spec()
    strategy = make_strategy(name, ds.model_spec(), TrainConfig(lr=lr, batch_size=10, local_epochs=1), {})
    result = simulate(strategy, clients, rounds, seed)
    return FmnistRun(ds, part, path, clients, name, rounds, seed, lr, result.global_state)
