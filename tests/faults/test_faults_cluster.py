"""Federations over the clustered broker (mqtt_broker.cluster: Aedes nodes sharing a real Redis), with the
coordinator and the devices as real ``flayer coordinator`` / ``flayer edge`` processes:

- three rounds with the coordinator on node 0 and the devices on the other nodes end with the same global
  model, bit for bit, and the same round history as the same run on one Mosquitto;
- the node that devices connect to is killed (SIGKILL) mid-round: they reconnect to another node (the
  failover addresses of their credentials), and every update a device saw acknowledged is journaled
  exactly once and folded (the accounting of test_faults_crash)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import faultlib
import pytest
import torch
from faultlib import (
    FEDERATION,
    ProcFederation,
    accounting,
    check_accounting,
    fold_journals,
    max_diff,
    proc_federation,
    wait_until,
)
from fedtestlib import FedBroker, wait_connectable
from test_faults_crash import _check_run, _hold_back

from mqtt_broker import BrokerConfig, add_device, load_credentials, mosquitto_available
from mqtt_broker.cluster import ClusterBroker, cluster_missing, start_cluster

MISSING = cluster_missing()
pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(MISSING is not None, reason=f"no broker cluster here: {MISSING}"),
]
DEVICES = ["dev-0", "dev-1", "dev-2"]
# round-history fields that follow from the computation alone (not time, nor wire bytes such as heartbeats)
# bytes_in is left out: it counts re-sent chunks too (coordinator/metrics.py), and a device re-sends a chunk
# whose acknowledgement came late, which a loaded machine decides, not the broker; the models, the accepted
# updates and the journals below are compared exactly
HISTORY = ("round", "selected", "received", "accepted", "rejected", "late", "closed", "devices", "acc", "train_loss",
           "model_bytes")


def start_cluster_fed(tmp: Path, devices: list[str], nodes: int = 3, **cfg: Any) -> FedBroker:
    """A cluster of ``nodes`` Aedes nodes with persistence, the devices' credentials written and loaded."""
    state = tmp / "broker"
    broker = start_cluster(BrokerConfig(federation=FEDERATION, persistence=True, **cfg), state, nodes)
    try:
        creds = {d: add_device(state, d) for d in devices}
        broker.reload()
        creds = {d: load_credentials(state, d) for d in devices}  # with their node and the failover nodes
        for c in creds.values():
            wait_connectable(c)
        return FedBroker(broker, state, creds, load_credentials(state, "coordinator"))  # type: ignore[arg-type]
    except BaseException:
        broker.stop()
        raise


def _cluster_federation(tmp: Path, ds: Any, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> ProcFederation:
    with monkeypatch.context() as m:
        m.setattr(faultlib, "start_persistent_broker", lambda t, devices, **cfg: start_cluster_fed(t, devices, **cfg))
        return proc_federation(tmp, ds, DEVICES, **kw)


def _run(fed: ProcFederation, timeout: float = 300) -> None:
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        fed.wait_all(timeout)
    finally:
        fed.stop()


def _history(fed: ProcFederation) -> list[dict[str, Any]]:
    return [{k: m.get(k) for k in HISTORY} for m in fed.metrics()]


@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_three_rounds_on_the_cluster_equal_the_run_on_one_mosquitto(
    tmp_path: Path, digits: Any, monkeypatch: pytest.MonkeyPatch, faults_ledger: Any
) -> None:
    single = proc_federation(tmp_path / "mosquitto", digits, DEVICES, rounds=3)
    _run(single)
    cluster = _cluster_federation(tmp_path / "cluster", digits, monkeypatch, rounds=3)
    broker = cluster.fb.broker
    assert isinstance(broker, ClusterBroker)
    coord_port = cluster.fb.coordinator.port
    device_ports = {cluster.fb.devices[d].port for d in DEVICES}
    assert coord_port == broker.ports[0] and coord_port not in device_ports  # devices on the other nodes
    _run(cluster)
    a, b = single.final_state(), cluster.final_state()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), "the global models differ"
    ha, hb = _history(single), _history(cluster)
    assert len(ha) == 3 and ha == hb, (ha, hb)
    acc = accounting(cluster)
    check_accounting(acc, 3)
    assert acc.acked == set(acc.journaled) == {(d, r) for d in DEVICES for r in (1, 2, 3)}
    assert max_diff(b, fold_journals(cluster, cluster.make_strategy(digits))) == 0.0
    acked, aggregated = len(acc.acked), acc.aggregated
    faults_ledger.fault("3 rounds over a 3-node Aedes cluster, compared with one Mosquitto", 0, True, acked,
                        aggregated)


def test_the_devices_node_killed_mid_round_they_fail_over_and_no_acknowledged_update_is_lost(
    tmp_path: Path, digits: Any, monkeypatch: pytest.MonkeyPatch, faults_ledger: Any
) -> None:
    fed = _cluster_federation(tmp_path, digits, monkeypatch, rounds=3)
    broker = fed.fb.broker
    assert isinstance(broker, ClusterBroker)
    nodes = {d: broker.ports.index(fed.fb.devices[d].port) for d in DEVICES}
    victim_node = Counter(nodes.values()).most_common(1)[0][0]
    assert victim_node != 0  # the coordinator's node stays up
    victim = next(d for d in DEVICES if nodes[d] == victim_node)
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        r = _hold_back(fed, victim, range(2, 4))  # the victim paused, the round open
        broker.kill_node(victim_node)
        time.sleep(0.5)
        fed.procs[victim].resume()  # its update now goes through another node
        fed.wait_all(300)
        assert (r, "accepted") in fed.device_acks(victim)
        moved = [d for d in DEVICES if nodes[d] == victim_node]
        log_text = "\n".join(fed.procs[d].text() for d in moved)
        assert f":{broker.ports[victim_node]}" in log_text and "next attempt on" in log_text, log_text[-3000:]
        acked, aggregated = _check_run(fed, digits)
        faults_ledger.fault(f"aedes node {victim_node} of 3 kill -9 mid-round {r}; {len(moved)} device(s) fail over",
                            1, True, acked, aggregated)
    finally:
        fed.stop()
    wait_until(lambda: not broker.is_running(), 10, "the cluster to stop")
