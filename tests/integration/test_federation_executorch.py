"""A federation over a real broker where one device runs ``runtime = "executorch"`` (its local SGD in
the model's ExecuTorch training program) beside a torch device: the coordinator's final model equals
the all-torch in-process simulation within the export parity tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fedtestlib import device_toml, federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.config import TrainConfig
from flayer.partition import make_partition, save_partition
from flayer.registry import with_fingerprint
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from flayer.train import client_data
from mqtt_broker import mosquitto_available

pytest.importorskip("executorch")
# slow set: tests/export/test_et_runtime.py runs a federation through the ExecuTorch program against torch
# in process, and test_federation_rounds.py the devices over the broker; CI runs this one too (make test-slow)
pytestmark = [pytest.mark.integration, pytest.mark.slow]
DEVICES = ["dev-torch", "dev-et"]


@pytest.mark.timeout(600)
def test_an_executorch_device_and_a_torch_device_match_the_simulator(tmp_path: Path, digits: Any) -> None:
    # 300 images: dev-et's SGD runs in ExecuTorch's portable kernels (~80x slower than torch), and the
    # parity needs steps, not data
    part = make_partition(digits.y, digits.num_classes, 2, "dir0.5", seed=0, samples=300,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-2.npz")
    clients = [client_data(digits, c) for c in part.clients]
    strategy = make_strategy("flayer", digits.model_spec(), TrainConfig(lr=0.005, batch_size=10, local_epochs=1), {})
    reference = simulate(strategy, clients, 2, 0).global_state

    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", DEVICES)
    devices: list[EdgeClient] = []
    try:
        fed = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                              tmp_path / "coord", strategy="flayer", rounds=2, dataset="digits", seed=0, lr=0.005,
                              quorum=2, min_devices=2, deadline_s=300.0)
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(DEVICES):
            runtime = "executorch" if name == "dev-et" else "torch"
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml", dataset="digits",
                               partition_file=pfile, client=i, state_dir=tmp_path / name, runtime=runtime)
            dev = EdgeClient(load_device_config(path).edge, fb.devices[name], clients[i])
            devices.append(dev)
            dev.start()
        thread.join(540)  # under pytest-timeout's 600 s, so a stall fails here, named
        assert not thread.is_alive(), "the coordinator did not finish"
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException), result
        assert result is not None and result.finished and result.rounds_done == 2
        for dev in devices:
            assert dev.wait(60) and dev.error is None and dev.rounds_trained == [1, 2], dev.error
        engine = devices[1].runtime.engines[with_fingerprint(digits.model_spec())]  # the plan carries it
        assert engine.steps >= 2 * (len(clients[1].train) // 10), "dev-et did not train through ExecuTorch"
        assert not devices[0].runtime.engines
        worst = max(float((result.global_state[k] - reference[k]).abs().max()) for k in reference)
        print(f"max |MQTT with an ExecuTorch device - simulate| = {worst:.3g}; {engine.steps} steps through ExecuTorch")
        assert worst <= 1e-4
        assert (tmp_path / "dev-et" / "personal.safetensors").exists()
    finally:
        for dev in devices:
            dev.stop()
        fb.broker.stop()
