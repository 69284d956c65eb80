"""One coordinator and 3 edge devices run 3 rounds on Fashion-MNIST shards over a real broker, and the
final global model equals the in-process simulator's for the same seed and partition.

Against Mosquitto every device is its own process (``flayer edge``) and so is the coordinator
(``flayer coordinator``); against the embedded broker they are threads of this process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fedtestlib import ROOT, device_toml, federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.state import load_tensors
from mqtt_broker import mosquitto_available
from protocol.metrics_schema import read_metrics

pytestmark = pytest.mark.integration


def _configs(tmp: Path, fb, run) -> tuple[Path, list[Path]]:  # type: ignore[no-untyped-def]
    fed = federation_toml(tmp / "federation.toml", fb.state_dir / "credentials/coordinator.toml", tmp / "coord",
                          strategy=run.strategy, rounds=run.rounds, dataset="fmnist", seed=run.seed, lr=run.lr,
                          quorum=len(run.devices), min_devices=len(run.devices), deadline_s=300.0)
    devs = [device_toml(tmp / f"{d}.toml", fb.state_dir / f"credentials/{d}.toml", dataset="fmnist",
                        partition_file=run.partition_file, client=i, state_dir=tmp / d)
            for i, d in enumerate(run.devices)]
    return fed, devs


def _assert_matches_simulator(state: dict[str, torch.Tensor], run) -> None:  # type: ignore[no-untyped-def]
    assert set(state) == set(run.reference)
    worst = max(float((state[k] - run.reference[k]).abs().max()) for k in state)
    moved = max(float((run.reference[k]).abs().max()) for k in state)
    print(f"{run.strategy}: max |MQTT - simulate| = {worst:.3g} (largest weight {moved:.3g})")
    assert worst <= 1e-6, f"MQTT run differs from flayer simulate by {worst:.3g}"
    assert moved > 0


def _check_outputs(tmp: Path, run) -> None:  # type: ignore[no-untyped-def]
    records = read_metrics(tmp / "coord/metrics.jsonl")  # validated against the metrics schema
    assert [r["kind"] for r in records] == ["run", "round", "round", "round", "end"]
    lines = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in lines] == [1, 2, 3]
    n = len(run.devices)
    assert all(r["reported"] == n and [d["result"] for d in r["devices"]] == ["accepted"] * n for r in lines)
    assert all(r["accepted"] == n and r["selected"] == run.devices and not r["rejected"] for r in lines)
    assert all(r["acc"] is not None and 0 < r["acc"] <= 1 for r in lines)
    for d in run.devices:
        assert (tmp / d / "personal.safetensors").exists(), f"{d} saved no personal model"


@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_three_rounds_separate_processes_match_the_simulator(tmp_path: Path, fmnist_run) -> None:  # type: ignore[no-untyped-def]
    fb = start_fed_broker(tmp_path, "mosquitto", fmnist_run.devices)
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        fed, devs = _configs(tmp_path, fb, fmnist_run)

        def launch(name: str, *argv: str) -> subprocess.Popen[bytes]:
            log = open(tmp_path / f"{name}.log", "wb")
            return subprocess.Popen([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)

        procs.append(launch("coordinator", "coordinator", "--config", str(fed)))
        procs += [launch(d, "edge", "--config", str(p)) for d, p in zip(fmnist_run.devices, devs)]
        t0 = time.monotonic()
        for p in procs:
            p.wait(timeout=max(1.0, 420 - (time.monotonic() - t0)))
        logs = {p.args[4] if len(p.args) > 4 else "?": p.returncode for p in procs}  # type: ignore[index]
        assert all(p.returncode == 0 for p in procs), (logs, (tmp_path / "coordinator.log").read_text()[-3000:])
        out = (tmp_path / "coordinator.log").read_text()
        n = len(fmnist_run.devices)
        assert f"round 3/3: {n}/{n} updates" in out and "3/3 rounds done" in out
        state, meta = load_tensors(tmp_path / "coord/global.safetensors")
        _assert_matches_simulator(state, fmnist_run)
        _check_outputs(tmp_path, fmnist_run)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        fb.broker.stop()


@pytest.mark.slow  # ~9 s; the same rounds over Mosquitto stay in the default run
def test_three_rounds_embedded_broker_match_the_simulator(tmp_path: Path, fmnist_run) -> None:  # type: ignore[no-untyped-def]
    fb = start_fed_broker(tmp_path, "embedded", fmnist_run.devices)
    clients: list[EdgeClient] = []
    try:
        fed, devs = _configs(tmp_path, fb, fmnist_run)
        cfg = load_coordinator_config(fed)
        coord = Coordinator(cfg, fb.coordinator)
        thread = coord.start()
        for i, path in enumerate(devs):
            dc = load_device_config(path)
            clients.append(EdgeClient(dc.edge, fb.devices[fmnist_run.devices[i]], fmnist_run.clients[i]))
            clients[-1].start()
        thread.join(300)
        assert not thread.is_alive(), "the coordinator did not finish"
        result = coord._thread_result
        assert not isinstance(result, BaseException), result
        assert result is not None and result.finished and result.rounds_done == 3
        for c in clients:
            assert c.wait(60) and c.error is None and c.rounds_trained == [1, 2, 3]
        _assert_matches_simulator(result.global_state, fmnist_run)
        _check_outputs(tmp_path, fmnist_run)
    finally:
        for c in clients:
            c.stop()
        fb.broker.stop()
