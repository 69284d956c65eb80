"""Bad calibration reports against real processes: ``flayer coordinator`` (PLayer-FL, round 0) and two
honest ``flayer edge`` devices on a real Mosquitto, three crafted devices sending a report whose
sample_weight is 2^32 - 1, a report missing a layer, and a report of 3e38 values. The coordinator
refuses all three (at arrival, or when it resolves), resolves the same split as the honest devices'
reports give in process, runs the federation to the end and exits 0."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from craft import Device
from faultlib import FEDERATION, proc_federation

from flayer.engine import calibrate, initial_global_state
from flayer.partition import make_partition
from flayer.train import client_data
from mqtt_broker import mosquitto_available
from protocol import Metrics, Topics, decode_message, encode_message

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
T = Topics(FEDERATION)
HONEST = ["dev-0", "dev-1"]
LAYERS = ("layer.1", "layer.2", "layer.3", "layer.4")
BAD = {  # crafted device -> its report
    "dev-x": {"layer.1": 0.5, "layer.2": 0.62, "layer.3": 0.7, "layer.4": 1.0, "sample_weight": float(2**32 - 1)},
    "dev-y": {"layer.1": 1.0, "layer.2": 1.0, "layer.3": 1.0, "sample_weight": 50.0},
    "dev-z": {**{k: 3e38 for k in LAYERS}, "sample_weight": 50.0},
}


def _report(dev: Device, values: dict[str, float]) -> str:
    payload = encode_message(Metrics(0, time.time(), values), FEDERATION, dev.id, key=dev.key)
    dev.publish([(T.metrics(dev.id), payload)])
    return decode_message(payload)[0].digest


def test_bad_calibration_reports_are_refused_and_the_run_completes(tmp_path: Path, digits: Any) -> None:
    devices = [*HONEST, *BAD]
    fed = proc_federation(tmp_path, digits, devices, rounds=1, strategy="playerfl",
                          fed={"quorum": 2, "min_devices": len(devices), "over_selection": 2.5,
                               "deadline_s": 120.0, "calibration_s": 30.0})
    crafted = {name: Device(fed.fb.devices[name], T) for name in BAD}
    try:
        for d in HONEST:
            fed.start_device(d)
        coord = fed.start_coordinator()
        plans = {name: dev.plan(0, 90) for name, dev in crafted.items()}
        assert all(p.phase == "calibrate" and name in p.selected for name, p in plans.items())
        acks = {name: dev.ack(_report(dev, BAD[name]), 30) for name, dev in crafted.items()}
        assert acks["dev-x"].status == "rejected" and "sample_weight" in acks["dev-x"].reason, acks["dev-x"]
        fed.wait_all(240, [coord, *fed.devices.values()])
        log = coord.text()
        for name in ("dev-y", "dev-z"):  # refused at arrival: the coordinator's calibration knows its strategy
            assert acks[name].status == "rejected" and acks[name].reason, (acks[name], log)
        assert "falling back" not in log, log[-3000:]
        m = fed.metrics()
        assert [r["round"] for r in m] == [1] and m[0]["accepted"] == 2, fed.logs()
        split = crafted["dev-x"].plan(1, 10).options["split"]
        part = make_partition(digits.y, digits.num_classes, len(devices), "iid", fed.seed)
        shards = [client_data(digits, part.clients[i]) for i in range(len(HONEST))]
        sim = fed.make_strategy(digits)
        _, resolved = calibrate(sim, shards, initial_global_state(sim, fed.seed), fed.seed)
        assert split == resolved["split"], (split, resolved)
    finally:
        for dev in crafted.values():
            dev.close()
        fed.stop()
