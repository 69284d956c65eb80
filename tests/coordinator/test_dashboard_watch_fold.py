"""The fleet watch's fold under a flood (coordinator/dashboard/watch.py, rules 1-3): the queue the
observer's link fills is bounded (messages beyond it dropped and counted, connection events kept), and
messages are decoded outside the lock the consumers (snapshot, wait_change) take, a bounded batch per
hold of it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import coordinator.dashboard.watch as watch_mod
from coordinator.dashboard.watch import FleetWatch
from protocol import Status, Topics, encode_message
from transport.link import Disconnected, Received

FED = "fold"


def _status_msg(i: int) -> Received:
    payload = encode_message(Status(1, "idle", time.time(), {}), FED, f"dev-{i:05d}")
    return Received(Topics(FED).status(f"dev-{i:05d}"), payload, False)


def _watch(tmp_path: Path) -> FleetWatch:
    w = FleetWatch(None, None)
    w.topics = Topics(FED)  # as with the observer's credentials, without a broker
    return w


def test_messages_are_decoded_outside_the_consumers_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _watch(tmp_path)
    free: list[bool] = []
    real = watch_mod.decode_message

    def probing(*args, **kwargs):  # type: ignore[no-untyped-def]
        def attempt() -> None:  # another thread, as a consumer would be
            ok = w._cond.acquire(blocking=False)
            if ok:
                w._cond.release()
            free.append(ok)

        t = threading.Thread(target=attempt)
        t.start()
        t.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(watch_mod, "decode_message", probing)
    for i in range(20):
        w.events.put(_status_msg(i))
    w.start()
    try:
        deadline = time.monotonic() + 10
        while len(w.snapshot()["devices"]) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        w.stop()
    assert len(w.view.devices) == 20 and len(free) == 20
    assert all(free), f"the lock was held while decoding {free.count(False)} of 20 messages"


def test_the_queue_is_bounded_and_each_hold_of_the_lock_folds_a_bounded_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_mod, "MAX_QUEUED", 100)
    monkeypatch.setattr(watch_mod, "BATCH", 30)
    w = _watch(tmp_path)
    msgs = [_status_msg(i) for i in range(130)]
    for m in msgs:
        w.enqueue(m)  # the link's callback: never blocks on a message
    assert w.events.qsize() == 100 and w.dropped == 30
    w.fold_once(wait_s=0.0)
    assert len(w.view.devices) == 30 and w.events.qsize() == 70  # one batch per hold of the lock
    w.enqueue(Disconnected("gone"))  # a connection event is kept while there is room
    assert w.events.qsize() == 71
    while w.events.qsize():
        w.fold_once(wait_s=0.0)
    assert len(w.view.devices) == 100 and not w.connected
