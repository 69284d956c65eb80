"""A crashed device rejoins and resumes from its on-disk state: three emulated devices (FLAYER, which
keeps a personal head and its accuracy signal between rounds) in a worker host of this process, the
real coordinator in a thread, a real broker. One device crashes right after sending its round-2
update; the broker publishes its last will (the coordinator sees it offline); it reboots a second
later as a new EdgeClient over the same state folder, which loads exactly the state it saved, does not
train round 2 again, and trains round 3; every round gets all three updates."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from emutestlib import events_of, start_test_broker, wait_until

from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore
from emulator.fleet import FleetSpec
from emulator.options import DEFAULT_EDGE
from emulator.profiles import DeviceProfile
from emulator.worker import build_host

pytestmark = pytest.mark.integration


def test_crashed_device_rejoins_and_resumes_from_disk(tmp_path: Path, digits: Any) -> None:
    from coordinator.config import load_coordinator_config
    from coordinator.server import Coordinator
    from flayer.partition import make_partition, save_partition

    ids = ["dev-000", "dev-001", "dev-002"]
    tb = start_test_broker(tmp_path, ids)
    part = make_partition(digits.y, digits.num_classes, 3, "iid", 0,
                          meta={"dataset": "digits", "dataset_fingerprint": digits.fingerprint()})
    part_file = save_partition(part, tmp_path / "partition.npz")
    fed = tmp_path / "federation.toml"
    fed.write_text(f'[federation]\ncredentials = "{tb.state}/credentials/coordinator.toml"\n'
                   f'state_dir = "{tmp_path}/coord"\nquorum = 3\nmin_devices = 3\nover_selection = 1.0\n'
                   f'grace_s = 0.0\ndeadline_s = 120.0\n[run]\nstrategy = "flayer"\nrounds = 3\n'
                   f'[data]\ndataset = "digits"\n[train]\nlr = 0.05\n')
    coord = Coordinator(load_coordinator_config(fed), tb.coordinator)
    spec = FleetSpec(federation="etest", devices=tuple(ids), profile_of=("fast",) * 3,
                     profiles={"fast": DeviceProfile("fast", up_mbps=50.0, down_mbps=50.0)}, seed=0,
                     dataset="digits",
                     partition_file=str(part_file), credentials_dir=str(tb.state / "credentials"),
                     state_root=str(tmp_path / "devices"), events_dir=str(tmp_path / "events"),
                     edge=EdgeSettings(**{**DEFAULT_EDGE, "heartbeat_s": 1.0, "ack_timeout_s": 5.0}))
    host, events = build_host(spec, 0, dataset=digits)
    victim = host.devices[1]
    coord_thread = coord.start()
    host_thread = threading.Thread(target=host.run, daemon=True)
    host_thread.start()
    try:
        def trained(dev: str, r: int) -> bool:
            return any(e["kind"] == "trained" and e["device"] == dev and e["round"] == r
                       for e in events_of(tmp_path))

        wait_until(lambda: trained("dev-001", 2), 120, "dev-001 to send its round-2 update")
        victim.post("crash")
        wait_until(lambda: victim.state == "crashed", 15, "the crash")
        victim.client.jobs.shutdown(wait=True)  # type: ignore[union-attr]
        saved = DeviceStore(tmp_path / "devices/dev-001").load()
        assert saved.done_round == 2 and saved.state is not None
        wait_until(lambda: not coord.registry.is_online("dev-001", time.time()), 15,
                   "the coordinator to see the last will (offline)")
        first_instance = victim.client.rounds_trained  # type: ignore[union-attr]
        assert first_instance == [1, 2]
        time.sleep(1.0)
        victim.post("online")  # the reboot
        wait_until(lambda: victim.state == "online" and victim.client is not None, 15, "the reboot")
        rebooted = victim.client
        assert rebooted is not None and rebooted.stored.done_round == 2
        resumed = rebooted.store.state_of(rebooted.stored)  # held, or (idle) read back from its state file
        assert resumed is not None
        for k, v in saved.state.tensors.items():  # the new instance resumes from exactly what was on disk
            assert torch.equal(resumed.tensors[k], v), k
        assert resumed.scalars == saved.state.scalars
        coord_thread.join(180)
        assert not coord_thread.is_alive(), "the federation did not finish"
        result = coord._thread_result
        assert not isinstance(result, BaseException) and result is not None and result.finished
        assert [r["accepted"] for r in result.history] == [3, 3, 3]
        wait_until(lambda: rebooted.rounds_trained == [3], 30, "the rebooted device to train round 3")
        host.wrap_up()
        host_thread.join(60)
        assert not host_thread.is_alive()
        evs = events_of(tmp_path)
        assert [e["done_round"] for e in evs if e["kind"] == "restart" and e["device"] == "dev-001"] == [2]
        rounds = sorted(e["round"] for e in evs if e["kind"] == "trained" and e["device"] == "dev-001")
        assert rounds == [1, 2, 3]
        assert victim.crashes == 1 and victim.instances == 2 and victim.final_acc is not None
        assert all(d.state == "finished" for d in host.devices)
    finally:
        host.stop()
        coord.stop()
        host_thread.join(30)
        coord_thread.join(30)
        events.close()
        tb.broker.stop()
