"""A hostile device's floods against a live coordinator (the real server loop, in this process) on a real
Mosquitto: unfinished blobs filling ``max_pending_bytes`` do not get an honest device's chunks refused (nor
count towards its cut-off), and 10,000 chunks refused before decoding (late, not selected) are all counted
while the coordinator's log gets a few lines and one summary line, and its memory of answered blobs stays
bounded."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from campaign import SELECTED, T, live_coordinator
from craft import Device, chunks, honest_update
from faultlib import FEDERATION, wait_until
from fedtestlib import FedBroker

from coordinator.inbox import ANSWERED_PER_SENDER, LOG_FIRST
from flayer.engine import initial_global_state
from mqtt_broker import mosquitto_available
from protocol import UpdateHeader

pytestmark = [
    pytest.mark.faults,
    pytest.mark.integration,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed"),
]
UPDATE_BYTES = 400_000  # max_update_bytes: an honest digits update is about 362 kB
PENDING_BYTES = 800_000  # max_pending_bytes


def _finished(coord: Any, thread: Any) -> Any:
    thread.join(60)
    result = coord._thread_result
    assert not isinstance(result, BaseException) and result is not None and result.finished, result
    return result


def _junk_firsts(n: int, seed: int) -> list[bytes]:
    """The first halves (190 kB each) of ``n`` 380 kB blobs of dev-a, whose second halves never come."""
    rng = np.random.default_rng(seed)
    return [chunks(rng.bytes(380_000), "dev-a", 1, size=190_100 + 64)[0] for _ in range(n)]  # 64: the signature


def test_unfinished_blobs_filling_the_budget_do_not_get_honest_chunks_refused(
    tmp_path: Path, live_fed: FedBroker, faults_ledger: Any
) -> None:
    """dev-a fills max_pending_bytes with unfinished blobs before and while dev-b sends; dev-b's update is
    accepted (before, its chunks were refused ``bad_chunk`` and cut it off), dev-a's oldest blobs make room
    (``incomplete``), nobody is struck, and dev-a's own honest update still gets through afterwards."""
    coord = live_coordinator(tmp_path, live_fed, rounds=1, max_update_bytes=UPDATE_BYTES,
                             max_pending_bytes=PENDING_BYTES)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    try:
        plan = a.plan(1)
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        honest = {d.id: honest_update(shapes, UpdateHeader(FEDERATION, 1, d.id, plan.model_digest), seed=i)
                  for i, d in enumerate((a, b, c))}
        a.send_chunks(_junk_firsts(4, 0), 1, [0] * 4)  # 760 kB held: alone, dev-a's share is the whole budget
        wait_until(lambda: coord.inbox.collector.pending_bytes >= 4 * 190_000, 30, "the flood")
        digest_b = b.send(honest["dev-b"], 1)
        a.send_chunks(_junk_firsts(4, 1), 1, [0] * 4)  # more, while dev-b's blob is (maybe) unfinished
        assert b.ack(digest_b).status == "accepted", "dev-b was refused: another device filled the budget"
        assert coord.inbox.strikes == {}
        for dev in (c, a):
            assert dev.ack(dev.send(honest[dev.id], 1)).status == "accepted"
        rec = _finished(coord, thread).history[0]
        assert rec["accepted"] == 3 and rec["rejected"] == {"incomplete": 8}, rec["rejected"]
        faults_ledger.bad_input("unfinished blobs filling max_pending_bytes", 8, rec["rejected"]["incomplete"])
        faults_ledger.attack("unfinished blobs filling max_pending_bytes", 8, honest_lost=0, crashes=0)
    finally:
        for dev in (a, b, c):
            dev.close()
        coord.stop()


def test_a_flood_of_late_and_unselected_chunks_is_counted_but_logged_in_a_summary(
    tmp_path: Path, live_fed: FedBroker, caplog: pytest.LogCaptureFixture, faults_ledger: Any
) -> None:
    """In round 2, dev-x (authorised, never selected) sends 6,000 one-chunk blobs for round 1 (late) and
    4,000 for round 2 (not selected): every one counted and answered, the answered blobs remembered within
    the per-sender bound, and the log holds LOG_FIRST lines and a notice about dev-x, then one summary line
    when round 2 closes. The honest devices' updates are all accepted."""
    caplog.set_level(logging.WARNING, logger="coordinator")
    n_late, n_unselected = 6000, 4000
    coord = live_coordinator(tmp_path, live_fed, rounds=2)
    thread = coord.start()
    a, b, c = (Device(live_fed.devices[d], T) for d in SELECTED)
    x = Device(live_fed.devices["dev-x"], T, online=False)
    try:
        shapes = {k: tuple(v.shape) for k, v in initial_global_state(coord.strategy, 0).items()}
        for r in (1, 2):
            plan = a.plan(r)
            if r == 2:
                flood = [(T.update_chunk("dev-x", 1 if i < n_late else 2, 0),
                          chunks(f"junk {i}".encode(), "dev-x", 1 if i < n_late else 2)[0])
                         for i in range(n_late + n_unselected)]
                x.publish(flood, timeout=120)
                wait_until(lambda: coord.counters["late"] + coord.counters["not_selected"] == len(flood), 60,
                           "the flood to be counted")
                assert coord.counters["late"] == n_late and coord.counters["not_selected"] == n_unselected
                assert len(coord.inbox._answered) <= ANSWERED_PER_SENDER
                about_x = [m for m in _inbox_lines(caplog) if "dev-x" in m]
                assert len(about_x) == LOG_FIRST + 1, about_x[-3:]
            for i, dev in enumerate((a, b, c)):
                blob = honest_update(shapes, UpdateHeader(FEDERATION, r, dev.id, plan.model_digest), seed=10 * r + i)
                assert dev.ack(dev.send(blob, r)).status == "accepted"
        result = _finished(coord, thread)
        assert [h["accepted"] for h in result.history] == [3, 3]
        assert result.history[1]["rejected"] == {"late": n_late, "not_selected": n_unselected}
        about_x = [m for m in _inbox_lines(caplog) if "dev-x" in m]
        total = n_late + n_unselected - LOG_FIRST
        assert len(about_x) == LOG_FIRST + 2 and about_x[-1] == (
            f"dev-x: {total:,} more refusals (late: {n_late - LOG_FIRST:,}, not_selected: {n_unselected:,}) "
            "in round 2")
        faults_ledger.bad_input("10,000 late and unselected chunks (logged in a summary)", len(flood),
                                n_late + n_unselected)
    finally:
        for dev in (a, b, c, x):
            dev.close()
        coord.stop()


def _inbox_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "coordinator.inbox"]
