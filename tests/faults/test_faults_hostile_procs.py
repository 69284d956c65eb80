"""One hostile device against real processes: ``flayer coordinator`` and two honest ``flayer edge``
devices on a real Mosquitto, the attacker publishing with its own credentials into its own topics
as round 2 opens -- decompression bombs, a flood of junk chunks up to the broker's packet size,
retained junk and garbage metrics. The honest devices' round-2 updates are all aggregated, the
coordinator's peak RSS stays within a stated bound, every refusal is counted by reason in
metrics.jsonl, the global model stays finite, and the coordinator restarts cleanly over its folder."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from craft import Device, chunks
from faultlib import FEDERATION, proc_federation, wait_until

from flayer.update import TensorDelta, Update
from mqtt_broker import mosquitto_available
from protocol import Topics, UpdateHeader, UpdateOptions, encode_update

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
T = Topics(FEDERATION)
HONEST = ["dev-0", "dev-1"]
BASE_AT = 16  # offset of the base model digest in an update blob's header (protocol/update_codec.py)
RSS_BOUND_MB = 150  # the coordinator's peak RSS may grow by at most this much during the attack


def _vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_hostile_device_against_real_processes(tmp_path: Path, digits: Any, faults_ledger: Any) -> None:
    fed = proc_federation(tmp_path, digits, [*HONEST, "dev-x"], rounds=3,
                          fed={"quorum": 2, "min_devices": 3, "over_selection": 1.5, "deadline_s": 120.0})
    x = Device(fed.fb.devices["dev-x"], T)
    bombs, junk, retained = 500, 150, 20
    try:
        pad = 16 * 2**20
        bomb = encode_update(Update({"pad": TensorDelta((pad,), np.zeros(pad, np.float32))}, 50),
                             UpdateHeader(FEDERATION, 2, "dev-x", "00" * 32), UpdateOptions(zstd=True, zstd_level=1))
        for d in HONEST:
            fed.start_device(d)
        coord = fed.start_coordinator()
        wait_until(lambda: 1 in fed.closed_rounds(), 120, "round 1 to close", fed.logs)
        for d in HONEST:  # the attack goes out as round 2 opens, ahead of the honest uploads
            fed.procs[d].pause()
        plan = x.plan(2, 60)
        base = _vm_hwm_mb(coord.pid)
        bomb = bomb[:BASE_AT] + bytes.fromhex(plan.model_digest) + bomb[BASE_AT + 32:]
        (one,) = chunks(bomb, "dev-x", 2, size=len(bomb) + 200, federation=FEDERATION)
        x.send_chunks([one] * bombs, 2, [0] * bombs)
        x.send_chunks([bytes([i % 256]) * 1_000_000 for i in range(junk)], 2, list(range(junk)))
        x.publish([(T.update_chunk("dev-x", 2, 10_000 + i), b"r" * 100_000) for i in range(retained)], retain=True)
        x.publish([(T.metrics("dev-x"), b"garbage")])
        for d in HONEST:
            fed.procs[d].resume()
        wait_until(lambda: 2 in fed.closed_rounds(), 120, "round 2 to close", fed.logs)
        peak = _vm_hwm_mb(coord.pid)
        fed.wait_all(120, [coord, *fed.devices.values()])
        m = {r["round"]: r for r in fed.metrics()}
        assert sorted(m) == [1, 2, 3] and all(m[r]["accepted"] == 2 for r in m), fed.logs()
        assert set(fed.journaled(2)) == set(HONEST)
        # what of dev-x's traffic was still on its way when round 2 closed (quorum: the honest two) is refused
        # in round 3: every message counted exactly once over both rounds
        rej = Counter(m[2]["rejected"]) + Counter(m[3]["rejected"])
        assert rej["oversize"] == 3 and rej["bad_message"] == 1, rej
        assert rej["oversize"] + rej["cut_off"] + rej["queue_full"] + rej["bad_chunk"] == bombs + junk + retained, rej
        assert m[3]["counters"].get("retained", 0) + m[2]["counters"].get("retained", 0) >= retained
        assert all(bool(torch.isfinite(v).all()) for v in fed.final_state().values())
        assert peak - base < RSS_BOUND_MB, (base, peak)
        again = fed.start_coordinator()  # a restart over its own folder: nothing to do, exits 0
        fed.wait_all(60, [again])
        faults_ledger.bad_input("decompression bombs + junk chunks + retained junk (processes)",
                                bombs + junk + retained + 1, bombs + junk + retained + 1)
        faults_ledger.attack("bombs + 150 MB junk + retained junk vs flayer processes", bombs + junk + retained + 1,
                             honest_lost=0, crashes=0, peak_rss_mb=round(peak, 1))
        print(f"coordinator VmHWM {base:.0f} MB before the attack, {peak:.0f} MB after; rejected {rej}")
    finally:
        x.close()
        fed.stop()
