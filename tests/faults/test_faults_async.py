"""Asynchronous buffered rounds under crashes of real processes: a device killed (SIGKILL) right after it
sent an update, and the coordinator killed with one update in a half-full buffer, both restarted over
the same state. Checked by journal accounting (every update a device saw acknowledged is journaled
exactly once, every version folded what its journal holds) and by folding the journals again with
their staleness weights, which must give the final model bit for bit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from faultlib import proc_federation, wait_until

from coordinator.journal import journal_path, read_journal
from flayer.engine import Bounds, OpenAggregate, admit, check, initial_global_state
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
                          fed={"mode": "async", "buffer": 2, "max_staleness": MAX_STALENESS, "quorum": 1,
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
