"""Asynchronous buffered rounds under crashes of real processes: a device killed (SIGKILL) right after it
sent an update, and the coordinator killed with one update in a half-full buffer, both restarted over
the same state. Checked by journal accounting (every update a device saw acknowledged is journaled
exactly once, every version folded what its journal holds) and by folding the journals again with
their staleness weights, which must give the final model bit for bit."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from faultlib import proc_federation, wait_until

from coordinator.journal import journal_path, read_journal
from flayer.engine import Bounds, OpenAggregate, admit, check, initial_global_state
from flayer.state import load_tensors
from mqtt_broker import mosquitto_available
from protocol import decode_update

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
DEVICES = ["dev-0", "dev-1", "dev-2", "dev-3"]
MAX_STALENESS = 4


def test_async_kills_lose_no_acknowledged_update(tmp_path: Path, digits: Any, faults_ledger: Any) -> None:
    rounds = 5
    fed = proc_federation(tmp_path, digits, DEVICES, rounds=rounds,
                          fed={"mode": "async", "buffer": 2, "max_staleness": MAX_STALENESS, "concurrency": 0, "quorum": 1,
                               "min_devices": 4, "deadline_s": 60.0})
    journals = fed.coord_state / "journal"
    try:
        for d in DEVICES:
            fed.start_device(d)
        fed.start_coordinator()
        wait_until(lambda: "trained and sent" in fed.procs["dev-1"].text(), 180, "dev-1's first update", fed.logs)
        fed.procs["dev-1"].kill9()  # its ack may or may not have come: the stored upload decides after the reboot
        fed.start_device("dev-1")

        def half_full() -> int | None:
            for r in range(2, rounds + 1):
                path = journal_path(journals, r)
                if path.exists() and len(read_journal(path).updates) == 1 and r not in fed.closed_rounds():
                    return r
            return None

        wait_until(lambda: half_full() is not None, 180, "a buffer holding one update", fed.logs)
        fed.coordinator.kill9()
        r = half_full()
        fed.start_coordinator()
        fed.wait_all(300, [fed.coordinator, *fed.devices.values()])
        assert r is not None and f"replayed 1 journaled update(s) of round {r}" in fed.coordinator.text()

        acked = {(d, b) for d in DEVICES for b, s in fed.device_acks(d) if s in ("accepted", "duplicate")}
        journaled: Counter = Counter()
        per_version = {}
        for v in range(1, rounds + 1):
            recs = read_journal(journal_path(journals, v)).updates
            per_version[v] = len(recs)
            journaled.update((rec.client, rec.round) for rec in recs)
        assert acked <= set(journaled), f"acknowledged but not journaled: {sorted(acked - set(journaled))}"
        assert not [k for k, n in journaled.items() if n > 1], "an update was journaled twice"
        assert {int(m["round"]): int(m["accepted"]) for m in fed.metrics()} == per_version

        strategy = fed.make_strategy(digits)
        g = initial_global_state(strategy, fed.seed)
        bounds = Bounds(max_samples=100_000, max_staleness=MAX_STALENESS)
        for v in range(1, rounds + 1):
            agg = OpenAggregate(strategy, g)
            for rec in read_journal(journal_path(journals, v)).updates:
                up = decode_update(rec.data).update
                agg.fold(admit(up, check(up, agg.shapes), bounds, v - rec.round))
            g = agg.result()
        final = fed.final_state()
        assert all(bool((final[k] == g[k]).all()) for k in g), "the final model is not the journals' fold"
        faults_ledger.fault("async: a device and the coordinator kill -9, restarted", 2, True, len(acked),
                            sum(per_version.values()))
    finally:
        fed.stop()


def test_state_folder_write_error_stops_the_coordinator_cleanly_and_a_restart_resumes(tmp_path: Path,
                                                                                     digits: Any) -> None:
    """The journal of version 2 cannot be written (a directory stands where the file goes: the same error
    path as a full disk or a read-only folder): ``flayer coordinator`` stops with exit status 1 and a
    message naming the file -- no traceback --, version 1's checkpoint and journal stay readable, and the
    same command resumes once the cause is gone."""
    devices = DEVICES[:2]
    fed = proc_federation(tmp_path, digits, devices, rounds=3,
                          fed={"mode": "async", "buffer": 2, "max_staleness": MAX_STALENESS, "concurrency": 0,
                               "quorum": 1, "min_devices": 2, "deadline_s": 60.0})
    blocker = journal_path(fed.coord_state / "journal", 2)
    blocker.mkdir(parents=True)
    (blocker / "keep").write_text("a directory where the journal of version 2 must go")
    try:
        for d in devices:
            fed.start_device(d)
        first = fed.start_coordinator()
        first.popen.wait(240)
        out = first.text()
        assert first.popen.returncode == 1, out[-3000:]
        assert "round-000002.jnl" in out and "run the same command to resume" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert fed.closed_rounds() == [1]
        _, meta = load_tensors(fed.coord_state / "checkpoint.safetensors")  # whole: version 1 closed
        assert meta["round"] == 1
        assert len(read_journal(journal_path(fed.coord_state / "journal", 1)).updates) == 2
        shutil.rmtree(blocker)
        fed.start_coordinator()
        fed.wait_all(300)
        assert fed.closed_rounds() == [1, 2, 3]
    finally:
        fed.stop()
