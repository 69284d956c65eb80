"""A private federation over a real broker runs the private simulation's mechanism: one coordinator and 3 edge
devices (threads of this process) run 3 central-DP rounds on Fashion-MNIST shards; the devices clip with the
real edge code, the coordinator re-clips and folds a fixed-denominator sum. The coordinator's noise comes from
the operating system's CSPRNG (nobody can replay it, tests/attacks/test_attack_dp_replay.py); to compare the two
runs this test alone seeds it as ``flayer simulate --dp-seeded-noise`` does (the coordinator's ``noise_seed`` hook,
tests only), so the final global model is the simulator's and both spend the same epsilon. (Devices refuse a plan
without noise, so the runs cannot be compared at z = 0.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fedtestlib import device_toml, federation_toml, finished, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.config import TrainConfig
from flayer.privacy_config import PrivacySettings
from flayer.simulation import simulate
from flayer.strategies import make_strategy
from mqtt_broker import mosquitto_available
from protocol.metrics_schema import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 25 s beyond the shared fixture
PRIVACY: dict[str, Any] = {"enabled": True, "clip": 0.5, "noise_multiplier": 0.5, "population": 3, "delta": 0.01}


def test_private_rounds_over_the_broker_equal_the_simulator(tmp_path: Path, fmnist_run: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import coordinator.open_round as open_round
    from flayer.engine.round import noise_seed

    run = fmnist_run
    devices = run.devices
    strategy = make_strategy(run.strategy, run.dataset.model_spec(), TrainConfig(lr=run.lr, batch_size=10), {})
    reference = simulate(strategy, run.clients, run.rounds, run.seed, privacy=PrivacySettings(**PRIVACY),
                         seeded_noise=True)
    begin = open_round.OpenRound.begin.__func__  # type: ignore[attr-defined]

    def seeded_begin(cls: Any, number: int, *args: Any, **kw: Any) -> Any:
        return begin(cls, number, *args, **{**kw, "noise_seed": noise_seed(run.seed, number)})

    monkeypatch.setattr(open_round.OpenRound, "begin", classmethod(seeded_begin))
    fb = start_fed_broker(tmp_path, "mosquitto" if mosquitto_available() else "embedded", devices)
    clients: list[EdgeClient] = []
    try:
        fed = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                              tmp_path / "coord", strategy=run.strategy, rounds=run.rounds, dataset="fmnist",
                              seed=run.seed, lr=run.lr, quorum=len(devices), min_devices=len(devices), deadline_s=300.0)
        fed.write_text(fed.read_text() + "[privacy]\n" + "".join(
            f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in PRIVACY.items()))
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        thread = coord.start()
        for i, d in enumerate(devices):
            dc = load_device_config(device_toml(tmp_path / f"{d}.toml", fb.state_dir / f"credentials/{d}.toml",
                                                dataset="fmnist", partition_file=run.partition_file, client=i,
                                                state_dir=tmp_path / d))
            clients.append(EdgeClient(dc.edge, fb.devices[d], run.clients[i]))
            clients[-1].start()
        result = finished(coord, thread, 300, rounds=run.rounds)
        for c in clients:
            assert c.wait(60) and c.error is None and c.rounds_trained == [1, 2, 3]
        worst = max(float((result.global_state[k] - reference.global_state[k]).abs().max()) for k in result.global_state)
        assert worst <= 1e-6, f"the private MQTT run differs from flayer simulate by {worst:.3g}"
        plain = simulate(strategy, run.clients, run.rounds, run.seed).global_state
        assert max(float((plain[k] - reference.global_state[k]).abs().max()) for k in plain) > 1e-3  # DP did act
        rounds = [r for r in read_metrics(tmp_path / "coord/metrics.jsonl") if r["kind"] == "round"]
        assert [r["epsilon"] for r in rounds] == pytest.approx([r.epsilon for r in reference.rounds], rel=1e-9)
        assert all(0 < r.epsilon < float("inf") for r in reference.rounds)
        assert all(r["dp_clip"] == 0.5 and r["accepted"] == len(devices) for r in rounds)
    finally:
        for c in clients:
            c.stop()
        fb.broker.stop()
