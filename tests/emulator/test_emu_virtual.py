"""The fleet on a simulated clock (emulator.virtual, ``flayer emulate --virtual``): it repeats exactly,
it refuses what the coordinator would refuse, and its command writes what it says."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from emulator.availability import device_timeline
from emulator.profiles import DeviceProfile
from emulator.virtual import FleetTiming, online_intervals, run_virtual
from flayer.config import TrainConfig
from flayer.engine import AsyncSettings
from flayer.partition import make_partition
from flayer.strategies import make_strategy
from flayer.train import client_data

FAST = DeviceProfile("fast", slowdown=1.0, up_mbps=50.0, down_mbps=50.0)
THIN = DeviceProfile("thin", slowdown=1.0, up_mbps=5.0, down_mbps=50.0, up_latency_ms=300.0)


@pytest.fixture(scope="module")
def fleet(digits):  # type: ignore[no-untyped-def]
    part = make_partition(digits.y, digits.num_classes, 6, "iid", 0)
    clients = [client_data(digits, c) for c in part.clients]
    strategy = make_strategy("fedavg", digits.model_spec(None), TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    return strategy, clients


def _run(fleet, mode: str, profiles: list[DeviceProfile], rounds: int = 4, **kw):  # type: ignore[no-untyped-def]
    strategy, clients = fleet
    ids = [f"dev-{i}" for i in range(len(clients))]
    args = dict(mode=mode, quorum=3, over_selection=1.0, min_devices=3, deadline_s=20.0, grace_s=0.5,
                sample_cost_s=0.001)
    timing = FleetTiming(**{**args, **kw})  # type: ignore[arg-type]
    timelines = [device_timeline(p, 0, d) for p, d in zip(profiles, ids)]
    return run_virtual(strategy, clients, profiles, ids, timelines, rounds, 0, timing)


def test_online_intervals_follow_the_timeline() -> None:
    events = iter([(0.0, "online"), (5.0, "offline"), (7.0, "online"), (9.0, "crash"), (12.0, "online")])
    assert online_intervals(events, 100.0) == [(0.0, 5.0), (7.0, 9.0), (12.0, math.inf)]


def test_async_runs_repeat_exactly_and_weight_staleness(fleet) -> None:  # type: ignore[no-untyped-def]
    profiles = [FAST] * 4 + [THIN] * 2
    kw = dict(asynchronous=AsyncSettings(buffer=2, max_staleness=50, concurrency=0))
    a, b = _run(fleet, "async", profiles, rounds=10, **kw), _run(fleet, "async", profiles, rounds=10, **kw)
    assert a.digests == b.digests and len(a.digests) == 11  # the initial model and 10 versions
    assert [r["t"] for r in a.rounds] == [r["t"] for r in b.rounds]
    assert a.profiles["fast"]["accepted"] >= 8
    assert any(r["staleness_mean"] > 0 for r in a.rounds)  # the thin devices' updates arrive stale


def test_async_refuses_updates_beyond_max_staleness(fleet) -> None:  # type: ignore[no-untyped-def]
    res = _run(fleet, "async", [FAST] * 4 + [THIN] * 2, rounds=14,
               asynchronous=AsyncSettings(buffer=2, max_staleness=1, concurrency=0))
    assert res.profiles["thin"].get("stale", 0) >= 1
    assert res.profiles["thin"].get("accepted", 0) == 0


def test_sync_refuses_updates_after_the_round_closed(fleet) -> None:  # type: ignore[no-untyped-def]
    res = _run(fleet, "sync", [FAST] * 4 + [THIN] * 2, rounds=3, over_selection=2.0)  # all 6 selected
    assert len(res.rounds) == 3 and all(r["accepted"] >= 3 for r in res.rounds)
    thin = res.profiles["thin"]
    assert thin["late"] == thin["trained"] == 6 and thin.get("accepted", 0) == 0  # quorum + grace came first
    assert res.profiles["fast"]["accepted_share"] == 1.0


def test_the_command_writes_its_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    cfg = tmp_path / "fleet.toml"
    cfg.write_text("[run]\nstrategy = \"fedavg\"\nrounds = 3\nseed = 0\n[data]\ndataset = \"digits\"\n"
                   "partition = \"iid\"\nclients = 5\n[train]\nlr = 0.05\n[federation]\nquorum = 2\n"
                   "min_devices = 2\n[emulator]\nmix = \"jetson-orin=0.6,flaky-field=0.4\"\n")
    out = tmp_path / "out"
    assert main(["emulate", "--config", str(cfg), "--virtual", "--mode", "async", "--buffer", "2",
                 "--sample-cost", "0.001", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "async" and summary["versions"] == 3
    assert set(summary["profiles"]) == {"jetson-orin", "flaky-field"}
    assert "accepted share" in capsys.readouterr().out
    assert main(["emulate", "--config", str(cfg), "--virtual", "--budget", "-5", "--out", str(out)]) == 2
    assert "--budget must be a positive number" in capsys.readouterr().err
