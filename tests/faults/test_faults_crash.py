"""Crashes of real processes: the coordinator, Mosquitto and devices run as their own processes
(``flayer coordinator``, ``flayer edge``, ``mosquitto`` with persistence) and are killed with SIGKILL
by the PID this test started them with, mid-round, then restarted over the same state.

Each run is checked by journal accounting -- every update a device saw acknowledged is journaled
exactly once, and every round folded exactly what its journal holds -- and, with fixed participation
(every device selected every round, quorum = all), by comparing the final global model with an
uninterrupted run of the same seeds and partition (the in-process simulator, which the federation
tests show the MQTT run equals)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from craft import Device, honest_update
from faultlib import (
    FEDERATION,
    ProcFederation,
    accounting,
    check_accounting,
    fold_journals,
    kill9_broker,
    max_diff,
    proc_federation,
    reference_run,
    restart_broker,
    start_persistent_broker,
    wait_until,
)
from fedtestlib import federation_toml

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from flayer.engine import initial_global_state
from mqtt_broker import mosquitto_available
from protocol import Topics, UpdateHeader

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
DEVICES = ["dev-0", "dev-1", "dev-2"]
T = Topics(FEDERATION)


def _acked(fed: ProcFederation, name: str, round_: int) -> bool:
    return any(r == round_ and s in ("accepted", "duplicate") for r, s in fed.device_acks(name))


def _hold_back(fed: ProcFederation, victim: str, rounds: range, settle_s: float = 0.0) -> int:
    """Pause ``victim`` (SIGSTOP) as a round opens, so the round cannot close (quorum = all) while the
    other devices' updates are acknowledged; returns that round. A round the victim got into before
    the pause closes normally, and the next one is tried."""
    others = [d for d in fed.devices if d != victim]
    for r in rounds:
        wait_until(lambda r=r: r - 1 in fed.closed_rounds(), 120, f"round {r - 1} to close", fed.logs)  # type: ignore[misc]
        fed.procs[victim].pause()
        wait_until(
            lambda r=r: all(_acked(fed, d, r) for d in others) or r in fed.closed_rounds(),  # type: ignore[misc]
            120,
            f"the other devices' round-{r} acks",
            fed.logs,
        )
        time.sleep(settle_s)  # what the victim had already written to its socket still arrives: let it land first
        if victim not in fed.journaled(r) and r not in fed.closed_rounds():
            return r
        fed.procs[victim].resume()
    raise AssertionError("the victim always sent its update before it was paused")


def _check_run(fed: ProcFederation, ds: Any, expect_all: bool = True) -> tuple[int, int]:
    """Accounting, the model folded from the journals, and (fixed participation) the reference run.
    Returns (updates acknowledged to devices, updates aggregated)."""
    acc = accounting(fed)
    check_accounting(acc, fed.rounds)
    if expect_all:
        assert set(acc.journaled) == {(d, r) for d in fed.devices for r in range(1, fed.rounds + 1)}
        assert acc.acked == set(acc.journaled), "a device never saw its update acknowledged"
    strategy = fed.make_strategy(ds)
    final = fed.final_state()
    assert max_diff(final, fold_journals(fed, strategy)) == 0.0, "the final model is not the journals' fold"
    if expect_all:
        worst = max_diff(final, reference_run(fed, ds, strategy, len(fed.devices)))
        print(f"max |crashed run - uninterrupted run| = {worst:.3g}")
        assert worst <= 1e-6
    return len(acc.acked), acc.aggregated


def test_coordinator_kill9_mid_round_loses_no_acknowledged_update(
    tmp_path: Path, digits: Any, faults_ledger: Any
) -> None:
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=3)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        r = _hold_back(fed, "dev-2", range(2, 4))
        assert len(fed.journaled(r)) == 2  # two updates acknowledged, the round not final
        fed.coordinator.kill9()
        fed.procs["dev-2"].resume()  # its update goes out while no coordinator runs
        wait_until(lambda: f"round {r}: trained" in fed.procs["dev-2"].text(), 60, "dev-2's update", fed.logs)
        time.sleep(0.5)
        fed.start_coordinator()
        fed.wait_all(240)
        assert f"replayed 2 journaled update(s) of round {r}" in fed.coordinator.text()
        assert (r, "accepted") in fed.device_acks("dev-2")
        acked, aggregated = _check_run(fed, digits)
        faults_ledger.fault("coordinator kill -9 mid-round, restarted", 1, True, acked, aggregated)
    finally:
        fed.stop()


def test_mosquitto_kill9_restarted_empty_the_coordinator_publishes_again(
    tmp_path: Path, digits_shards: list, faults_ledger: Any
) -> None:
    """Mosquitto killed mid-round comes back without its retained messages (nothing saved since its
    last autosave); a device that connects after the restart still gets the round's plan and model,
    because the coordinator publishes them again when it reconnects."""
    fb = start_persistent_broker(tmp_path, ["dev-0", "dev-1"])
    path = federation_toml(
        tmp_path / "federation.toml",
        fb.state_dir / "credentials/coordinator.toml",
        tmp_path / "coord",
        strategy="fedavg",
        rounds=1,
        dataset="digits",
        quorum=2,
        min_devices=2,
        over_selection=1.0,
        deadline_s=120.0,
    )
    coord = Coordinator(load_coordinator_config(path), fb.coordinator)
    thread = coord.start()
    late, other = Device(fb.devices["dev-0"], T), Device(fb.devices["dev-1"], T)
    device: EdgeClient | None = None
    try:
        plan = other.plan(1)
        late.close()  # online when the round opened; its device is down until after the broker's restart
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        blob = honest_update(shapes, UpdateHeader(FEDERATION, 1, "dev-1", plan.model_digest), seed=1)
        assert other.ack(other.send(blob, 1)).status == "accepted"
        kill9_broker(fb)
        restart_broker(fb)
        assert not (fb.state_dir / "data/mosquitto.db").exists()  # nothing was saved: no retained message
        settings = EdgeSettings(
            state_dir=str(tmp_path / "dev-0"), client_index=0, device="cpu", heartbeat_s=1.0
        )
        device = EdgeClient(settings, fb.devices["dev-0"], digits_shards[0])
        device.start()
        thread.join(120)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished, result
        assert result.history[0]["accepted"] == 2 and device.rounds_trained == [1]
        assert device.wait(30) and device.error is None and device.finished
        faults_ledger.fault(
            "mosquitto kill -9 mid-round, restarted empty; a device joins after", 1, True, 2, 2
        )
    finally:
        if device is not None:
            device.stop()
        other.close()
        coord.stop()
        fb.broker.stop()


@pytest.mark.slow
def test_mosquitto_kill9_mid_round_devices_and_coordinator_reconnect(
    tmp_path: Path, digits: Any, faults_ledger: Any
) -> None:
    """Mosquitto with persistence is killed mid-round and restarted on the same port and state; one
    device, paused across the outage, is power-cycled too (it then needs the retained plan and model)."""
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=3)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        r = _hold_back(fed, "dev-2", range(2, 4))
        kill9_broker(fed.fb)
        time.sleep(1.0)
        restart_broker(fed.fb)
        fed.procs["dev-2"].kill9()
        fed.start_device("dev-2")
        fed.wait_all(240)
        assert (r, "accepted") in fed.device_acks("dev-2")
        acked, aggregated = _check_run(fed, digits)
        faults_ledger.fault(
            "mosquitto kill -9 mid-round, restarted (persistence on)", 1, True, acked, aggregated
        )
    finally:
        fed.stop()


@pytest.mark.slow
def test_a_third_of_the_devices_killed_mid_round(tmp_path: Path, digits: Any, faults_ledger: Any) -> None:
    """10 devices, quorum 8: 3 of the 10 selected for round 2 die (SIGKILL) as it opens. Round 2 closes
    at its deadline with the 7 others; the 3 reboot, and round 3 (opened once 8 are online) closes by
    quorum."""
    devices = [f"dev-{i}" for i in range(10)]
    fed = proc_federation(
        tmp_path,
        digits,
        devices,
        rounds=3,
        fed={"quorum": 8, "min_devices": 8, "over_selection": 1.25, "deadline_s": 20.0, "grace_s": 1.0},
    )
    try:
        for d in devices:
            fed.start_device(d)
        log = fed.fb.state_dir / "broker.log"
        wait_until(
            lambda: all(f" as {d} " in log.read_text() for d in devices), 120, "10 devices online", fed.logs
        )
        fed.start_coordinator()
        plan2 = fed.coord_state / "journal/round-000002.jnl"  # the plan is journaled before it goes out
        wait_until(plan2.exists, 180, "round 2 to open", fed.logs)
        # freeze every device at once (SIGSTOP, milliseconds after the plan was journaled: before any
        # could download the model and train), then kill three that have not touched round 2
        for d in devices:
            fed.procs[d].pause()
        fresh = [d for d in ("dev-1", "dev-4", "dev-7", *devices) if "round 2" not in fed.procs[d].text()]
        victims = list(dict.fromkeys(fresh))[:3]
        assert len(victims) == 3, "round 2 ran too far before the devices were frozen"
        for d in victims:
            fed.procs[d].kill9()
        for d in devices:
            if d not in victims:
                fed.procs[d].resume()
        wait_until(lambda: 2 in fed.closed_rounds(), 60, "round 2 to close", fed.logs)
        for d in victims:  # they reboot
            fed.start_device(d)
        fed.wait_all(240, [fed.coordinator, *fed.devices.values()])
        m = fed.metrics()
        print([(x["round"], x["accepted"], len(x["selected"]), x["closed"]) for x in m])
        assert not set(victims) & set(fed.journaled(2))
        assert (
            len(m[1]["selected"]) == 10
            and m[1]["accepted"] == 7
            and m[1]["closed"] == "deadline with 7 update(s)"
        )
        assert (
            len(m[2]["selected"]) >= 8
            and m[2]["accepted"] >= 8
            and m[2]["closed"].startswith(("every", "quorum"))
        )
        acked, aggregated = _check_run(fed, digits, expect_all=False)
        faults_ledger.fault(
            "3 of 10 devices kill -9 mid-round, rebooted", len(victims), True, acked, aggregated
        )
    finally:
        fed.stop()


@pytest.mark.slow
def test_coordinator_down_longer_than_the_devices_retries(tmp_path: Path, digits: Any, faults_ledger: Any) -> None:
    """The coordinator is killed and stays down until a device has given up re-sending (1 s ack timeout,
    one re-send). Its update waits in the coordinator's broker session; restarted, the coordinator
    folds it and acks it, and the device, although it gave up, records the ack."""
    edge = {"ack_timeout_s": 1.0, "retries": 1, "backoff_s": 0.2, "backoff_max_s": 0.5}
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=3, edge=edge)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        r = _hold_back(fed, "dev-2", range(2, 4))
        fed.coordinator.kill9()
        fed.procs["dev-2"].resume()
        wait_until(lambda: "giving up on it" in fed.procs["dev-2"].text(), 60, "dev-2 to give up", fed.logs)
        fed.start_coordinator()
        fed.wait_all(240)
        assert (r, "accepted") in fed.device_acks("dev-2")
        acked, aggregated = _check_run(fed, digits)
        faults_ledger.fault("coordinator down past the devices' re-sends", 1, True, acked, aggregated)
    finally:
        fed.stop()


def test_a_restarted_coordinator_still_knows_what_it_folded_last_round(
    tmp_path: Path, live_fed: Any, faults_ledger: Any
) -> None:
    """A device whose ack for round 1 was lost re-sends its round-1 update after the coordinator
    restarted in round 2: the answer is ``duplicate`` (it is in the aggregate), as without the restart,
    not ``late`` (which would tell the device it was refused)."""
    path = federation_toml(tmp_path / "federation.toml", live_fed.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=2, dataset="digits", quorum=2,
                           min_devices=2, over_selection=1.0, deadline_s=120.0)
    coord = Coordinator(load_coordinator_config(path), live_fed.coordinator)
    thread = coord.start()
    a, b = Device(live_fed.devices["dev-a"], T), Device(live_fed.devices["dev-b"], T)
    try:
        plan = a.plan(1)
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        blobs = {d.id: honest_update(shapes, UpdateHeader(FEDERATION, 1, d.id, plan.model_digest), seed=i)
                 for i, d in enumerate((a, b))}
        for dev in (a, b):
            assert dev.ack(dev.send(blobs[dev.id], 1)).status == "accepted"
        plan2 = a.plan(2)
        assert a.ack(a.send(blobs["dev-a"], 1)).status == "duplicate"  # the running coordinator knows
        coord.stop()
        thread.join(30)
        coord = Coordinator(load_coordinator_config(path), live_fed.coordinator)
        thread = coord.start()
        assert a.ack(a.send(blobs["dev-a"], 1)).status == "duplicate"  # and so does the restarted one
        for i, dev in enumerate((a, b)):
            blob = honest_update(shapes, UpdateHeader(FEDERATION, 2, dev.id, plan2.model_digest), seed=10 + i)
            assert dev.ack(dev.send(blob, 2)).status == "accepted"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert not isinstance(result, BaseException) and result is not None and result.finished
        assert [r["accepted"] for r in result.history] == [2]  # round 2, by the restarted coordinator
        faults_ledger.fault("coordinator restarted between rounds; last round's update re-sent", 1, True, 4, 4)
    finally:
        for dev in (a, b):
            dev.close()
        coord.stop()
