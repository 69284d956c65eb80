"""A finished federation extended by more rounds (the coordinator restarted with a larger ``rounds`` over
its own folder): a device that had finished trains the new rounds and saves its personal and global
models again at the new end, not the first end's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fedtestlib import device_toml, federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.partition import make_partition, save_partition
from flayer.state import load_tensors
from flayer.train import client_data

pytestmark = pytest.mark.integration


def _run(tmp: Path, fb: Any, rounds: int, device: Path, data: Any) -> EdgeClient:
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy="fedavg", rounds=rounds, dataset="digits", seed=0, lr=0.05, deadline_s=120.0)
    coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
    thread = coord.start()
    # devices restart after the coordinator (docs/howto/stop-resume.md): one started before it cleared the first
    # end's retained final plan would take that plan and stop (a slow start on a busy machine did)
    deadline = time.monotonic() + 120
    while not coord._connected_once and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert coord._connected_once, "the coordinator did not connect within 120 s"  # type: ignore[attr-defined]
    dev = EdgeClient(load_device_config(device).edge, fb.devices["dev-0"], data)
    dev.start()
    try:
        thread.join(150)
        assert not thread.is_alive(), "the coordinator did not finish"
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException), result
        assert result is not None and result.finished and result.rounds_done == rounds
        assert dev.wait(60) and dev.error is None, dev.error
    finally:
        dev.stop()
    return dev


def test_an_extended_run_saves_the_devices_models_again(tmp_path: Path, digits: Any) -> None:
    part = make_partition(digits.y, digits.num_classes, 1, "iid", seed=0, samples=200,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-1.npz")
    data = client_data(digits, part.clients[0])
    fb = start_fed_broker(tmp_path, "embedded", ["dev-0"])
    try:
        device = device_toml(tmp_path / "dev-0.toml", fb.state_dir / "credentials/dev-0.toml", dataset="digits",
                             partition_file=pfile, client=0, state_dir=tmp_path / "dev-0")
        first = _run(tmp_path, fb, 1, device, data)
        assert first.rounds_trained == [1]
        _, meta1 = load_tensors(tmp_path / "dev-0" / "personal.safetensors")
        assert meta1["rounds"] == 1
        again = _run(tmp_path, fb, 2, device, data)  # the same folders: the coordinator resumes, extends to 2
        assert again.rounds_trained == [2]
        for name in ("personal", "global"):
            _, meta = load_tensors(tmp_path / "dev-0" / f"{name}.safetensors")
            assert meta["rounds"] == 2, f"{name}.safetensors is still the first end's ({meta})"
        coord_state, _ = load_tensors(tmp_path / "coord" / "global.safetensors")
        dev_global, _ = load_tensors(tmp_path / "dev-0" / "global.safetensors")
        assert all(bool((coord_state[k] == dev_global[k]).all()) for k in coord_state)
    finally:
        fb.broker.stop()
