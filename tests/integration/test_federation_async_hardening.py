"""Asynchronous rounds against a device that does not play fair, on a live Mosquitto with the real
coordinator loop: a device offered five versions that sends an update trained from each of them into
one buffer gets one folded (the others acked ``late``, counter ``in_buffer``); 10,000 junk update chunks
cause no plan re-publication and add nothing to the journal (docs/explanation/async-rounds.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from fedtestlib import FedBroker, start_fed_broker
from test_federation_refusals import ManualDevice, T, _coordinator

from coordinator.journal import journal_path, read_journal
from mqtt_broker import mosquitto_available
from protocol import Kind, chunk_blob

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
DEVICES = ["dev-a", "dev-b", "dev-c"]
ASYNC = {"mode": "async", "min_devices": 3, "quorum": 1, "deadline_s": 120.0, "concurrency": 0, "max_staleness": 8,
         "buffer": 2}


@pytest.fixture
def fed(tmp_path: Path):  # type: ignore[no-untyped-def]
    fb = start_fed_broker(tmp_path, "mosquitto", DEVICES)
    yield fb
    fb.broker.stop()


def test_a_device_offered_five_versions_folds_one_update_into_a_buffer(tmp_path: Path, fed: FedBroker) -> None:
    coord = _coordinator(tmp_path, fed, rounds=5, **ASYNC)
    thread = coord.start()
    a, b, c = (ManualDevice(fed.devices[d]) for d in DEVICES)
    try:
        hoard = []  # dev-a trains from every version it is offered and keeps the updates back
        for v in range(1, 5):
            plan = a.plan(v)
            assert "dev-a" in plan.selected
            hoard.append((a.update_blob(plan, v, 0.5 / v), v))
            for dev, value in ((b, 0.1 * v), (c, -0.1 * v)):  # the honest devices fill buffer v
                assert dev.ack(dev.send(dev.update_blob(plan, v, value), v)).status == "accepted"
        p5 = a.plan(5)
        hoard.append((a.update_blob(p5, 5, 0.1), 5))
        first = a.ack(a.send(*hoard[0]))  # all five into the buffer of version 5, one after the other
        assert first.status == "accepted", first
        for blob, base in hoard[1:]:
            ack = a.ack(a.send(blob, base))
            assert ack.status == "late" and "one per device per version" in ack.reason, (base, ack)
        assert b.ack(b.send(b.update_blob(p5, 5, 0.3), 5)).status == "accepted"  # the buffer fills: version 6
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert result is not None and not isinstance(result, BaseException) and result.finished, result
        folded = [r.client for r in read_journal(journal_path(tmp_path / "coord" / "journal", 5)).updates]
        assert sorted(folded) == ["dev-a", "dev-b"]  # dev-a once: not the whole version
        last = result.history[-1]
        assert last["accepted"] == 2 and last["rejected"].get("in_buffer") == 4
        assert result.counters["in_buffer"] == 4
    finally:
        for d in (a, b, c):
            d.close()
        coord.stop()


def test_ten_thousand_junk_chunks_cause_no_plan_and_no_journal_growth(tmp_path: Path, fed: FedBroker) -> None:
    coord = _coordinator(tmp_path, fed, rounds=1, **ASYNC)
    thread = coord.start()
    a, b, c = (ManualDevice(fed.devices[d]) for d in DEVICES)
    journal = journal_path(tmp_path / "coord" / "journal", 1)
    try:
        p1 = a.plan(1)
        assert set(p1.selected) == set(DEVICES)
        a.rec.drain(1.5)  # the plan is settled: every device online holds a slot
        plans_seen = sum(m.topic == T.round() for m in a.rec.messages)
        size, records = journal.stat().st_size, len(read_journal(journal).plans)
        junk = []
        a_key = fed.devices["dev-a"].signer()  # dev-a's own junk, signed by dev-a
        for i in range(10_000):  # each a well-formed first chunk of its own blob, for rounds not open
            blob = os.urandom(24)
            round_ = 1000 + i % 7
            junk.append((T.update_chunk("dev-a", round_, 0), chunk_blob(blob, Kind.UPDATE_CHUNK, "itest", "dev-a",
                                                                          round_, 400, key=a_key)[0], False))
        assert a.rec.link.publish_all(junk, 120.0)
        marker = coord.counters["bad_message"]
        a.rec.link.publish_all([(T.metrics("dev-a"), b"marker", False)], 10.0)  # handled after the junk
        deadline = time.monotonic() + 120
        while coord.counters["bad_message"] <= marker and time.monotonic() < deadline:
            time.sleep(0.1)
        assert coord.counters["bad_message"] > marker, "the coordinator did not get through the junk"
        a.rec.drain(2.0)  # a re-plan would be out by now (plans go out within a second)
        refused = sum(v for k, v in coord.counters.items() if k in ("future_round", "cut_off", "queue_full",
                                                                      "bad_chunk"))
        assert refused >= 10_000 - coord.counters["queue_full"]
        assert sum(m.topic == T.round() for m in a.rec.messages) == plans_seen, "the junk re-published the plan"
        assert len(read_journal(journal).plans) == records and journal.stat().st_size == size
        for dev, value in ((b, 0.25), (c, -0.5)):  # the honest devices still fill the buffer
            assert dev.ack(dev.send(dev.update_blob(p1, 1, value), 1)).status == "accepted"
        thread.join(60)
        result = coord._thread_result  # type: ignore[attr-defined]
        assert result is not None and not isinstance(result, BaseException) and result.finished, result
    finally:
        for d in (a, b, c):
            d.close()
        coord.stop()
