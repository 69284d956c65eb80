"""Round 0 over the broker: a strategy that needs calibration gets every online device's report,
resolves them into an option, and every later plan (and the devices' strategy) carries it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fedtestlib import federation_toml, start_fed_broker

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer import strategies
from flayer.engine.calibration import robust_weights
from flayer.partition import make_partition
from flayer.strategies.fedavg import FedAvg
from flayer.train import ClientData, client_data
from mqtt_broker import mosquitto_available

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]


@dataclasses.dataclass(frozen=True)
class BoostOptions:
    boost: float | None = None  # decided in round 0: the sample-weighted mean of the devices' "n"


class Calibrating(FedAvg):
    """FedAvg that must learn one option from the clients' data first (the calibration interface)."""

    name = "playerfl"  # a name the run config accepts; the test puts this class in its place
    options_type = BoostOptions

    def needs_calibration(self) -> bool:
        return self.options.boost is None

    def calibrate(self, global_state: Mapping[str, torch.Tensor], data: ClientData, ctx: Any) -> dict[str, float]:
        assert ctx.round == 0
        return {"n": float(data.num_train)}

    def resolve_calibration(self, reports: Sequence[Mapping[str, float]], weights: Sequence[float]) -> dict[str, Any]:
        return {"boost": sum(r["n"] * w for r, w in zip(reports, weights)) / sum(weights)}

    def with_options(self, updates: Mapping[str, Any]) -> Calibrating:
        return type(self)(self.spec, self.train, {**dataclasses.asdict(self.options), **updates})


def test_calibration_round(tmp_path: Path, digits, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(strategies.STRATEGIES, "playerfl", Calibrating)
    fb = start_fed_broker(tmp_path, "mosquitto", ["dev-a", "dev-b"])
    part = make_partition(digits.y, digits.num_classes, 2, "iid", 0)
    shards = [client_data(digits, c) for c in part.clients]
    clients: list[EdgeClient] = []
    try:
        path = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                               tmp_path / "coord", strategy="playerfl", rounds=1, dataset="digits", quorum=2,
                               min_devices=2)
        coord = Coordinator(load_coordinator_config(path), fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(["dev-a", "dev-b"]):
            settings = EdgeSettings(state_dir=str(tmp_path / name), client_index=i, device="cpu", heartbeat_s=2.0)
            clients.append(EdgeClient(settings, fb.devices[name], shards[i]))
            clients[-1].start()
        thread.join(120)
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished, result
        n = [float(s.num_train) for s in shards]
        w = robust_weights(n)  # the claimed sample counts, none above the runner-up's
        expected = sum(x * y for x, y in zip(n, w)) / sum(w)
        assert coord.options == {"boost": pytest.approx(expected)}
        assert result.history[0]["accepted"] == 2
        for c in clients:
            assert c.wait(30) and c.error is None and c.rounds_trained == [1]
            assert c.plan is not None and c.plan.options == {"boost": pytest.approx(expected)}
            assert c.stored.extra.get("calibrated")  # the report was acknowledged
        from coordinator.checkpoint import load_checkpoint

        ckpt = load_checkpoint(tmp_path / "coord", coord.cycle.identity())
        assert ckpt is not None and ckpt.options == {"boost": pytest.approx(expected)}
    finally:
        for c in clients:
            c.stop()
        fb.broker.stop()


def test_playerfl_calibration_over_the_broker_matches_the_simulator(tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    """The real PLayer-FL: round 0 over MQTT resolves the same split as flayer.simulation.calibrate."""
    from flayer.config import TrainConfig
    from flayer.engine import calibrate, initial_global_state

    fb = start_fed_broker(tmp_path, "mosquitto", ["dev-a", "dev-b"])
    part = make_partition(digits.y, digits.num_classes, 2, "dir0.5", 0)
    shards = [client_data(digits, c) for c in part.clients]
    clients: list[EdgeClient] = []
    try:
        path = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                               tmp_path / "coord", strategy="playerfl", rounds=1, dataset="digits", quorum=2,
                               min_devices=2)
        cfg = load_coordinator_config(path)
        coord = Coordinator(cfg, fb.coordinator)
        thread = coord.start()
        for i, name in enumerate(["dev-a", "dev-b"]):
            settings = EdgeSettings(state_dir=str(tmp_path / name), client_index=i, device="cpu", heartbeat_s=2.0)
            clients.append(EdgeClient(settings, fb.devices[name], shards[i]))
            clients[-1].start()
        thread.join(180)
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished, result
        sim = strategies.make_strategy("playerfl", digits.model_spec(), coord.strategy.train)
        assert isinstance(coord.strategy.train, TrainConfig)
        _, resolved = calibrate(sim, shards, initial_global_state(sim, cfg.run.seed), cfg.run.seed)
        assert "split" in resolved and coord.options["split"] == resolved["split"]
        for c in clients:
            assert c.wait(30) and c.error is None and c.plan is not None
            assert c.plan.options["split"] == resolved["split"]
    finally:
        for c in clients:
            c.stop()
        fb.broker.stop()
