"""An adversary holding one device's credentials, selected in a round, announces an upload it will
never send (an endless one, or a short one before it vanishes): the round still closes, within
quorum + grace + ``announce_wait_s``, far before the deadline (coordinator.rounds, Announcements). It acts
with what a device has: its credentials, the retained plan it reads, the status messages it publishes."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fedtestlib import FedBroker, Recorder, federation_toml, finished, iid_shards
from test_federation_announce import clients_for

from coordinator.config import load_coordinator_config
from coordinator.server import Coordinator
from protocol import Plan, Status, Topics, decode_message, encode_message

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DEVICES = ["dev-a", "dev-b", "dev-slow"]


@pytest.fixture
def fed(attack_fed):  # type: ignore[no-untyped-def]
    return attack_fed(DEVICES[:-1], adversary="dev-slow", view="device")  # dev-slow: its own account only


@pytest.fixture(scope="module")
def shards(digits):  # type: ignore[no-untyped-def]
    return iid_shards(digits, 3)


def _hostile(fed: FedBroker, upload_s: float, vanish: bool, stop: threading.Event) -> threading.Thread:
    """``dev-slow`` as an adversary with its own credentials only: it says it is online, and once a plan
    selects it announces an upload of ``upload_s`` seconds for that round, then never sends one
    (``vanish``: it disconnects right after the announcement, without a word)."""
    creds = fed.devices["dev-slow"]
    key = creds.signer()  # the hostile device's own key: what it sends is its own
    topics = Topics(creds.federation)

    def run() -> None:
        rec = Recorder(creds, [topics.round()])
        announced: set[int] = set()
        try:
            while not stop.is_set():
                status = Status(0, "idle", time.time(), {})
                rec.link.publish(topics.status(creds.username), encode_message(status, creds.federation,
                                                                               creds.username, key=key), retain=True)
                m = rec.next(lambda e: hasattr(e, "payload") and e.topic == topics.round() and bool(e.payload), 0.5)
                if m is None:
                    continue
                _, plan = decode_message(m.payload)
                if isinstance(plan, Plan) and creds.username in plan.selected and plan.round not in announced:
                    announced.add(plan.round)
                    info: dict[str, Any] = {"upload_round": plan.round, "upload_bytes": 10**6, "upload_s": upload_s}
                    msg = Status(plan.round, "uploading", time.time(), info)
                    rec.link.publish(topics.status(creds.username), encode_message(msg, creds.federation,
                                                                                   creds.username, key=key))
                    if vanish:
                        time.sleep(0.5)  # the announcement on its way, then gone
                        return
        finally:
            rec.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(("upload_s", "vanish"), [(1e6, False), (30.0, True)])
def test_an_announced_upload_that_never_comes_holds_the_round_only_to_the_bound(
        tmp_path: Path, fed: FedBroker, shards: list, upload_s: float, vanish: bool) -> None:
    """A device claiming an endless upload in every round it is selected for, and one that announces a
    30 s upload and vanishes. With a 60 s deadline and announce_wait_s = 3, every round closes at
    quorum + grace + 3 s at most: under 30 s even on a busy machine, where waiting for the announced
    upload (or the deadline) would take 60 s."""
    path = federation_toml(tmp_path / "federation.toml", fed.state_dir / "credentials/coordinator.toml",
                           tmp_path / "coord", strategy="fedavg", rounds=2, dataset="digits", quorum=2,
                           min_devices=3, over_selection=1.5, grace_s=0.5, announce_wait_s=3.0)
    coord = Coordinator(load_coordinator_config(path), fed.coordinator)
    events: dict[str, list[tuple[str, dict]]] = {d: [] for d in DEVICES}
    honest = clients_for(tmp_path, fed, shards, events, up_mbps=0.0)[:2]
    stop = threading.Event()
    thread = coord.start()
    hostile = _hostile(fed, upload_s, vanish, stop)
    for c in honest:
        c.start()
    try:
        result = finished(coord, thread, 150, 2)
    finally:
        stop.set()
        for c in honest:
            c.stop()
        hostile.join(10)
    closes = [(r["accepted"], r["closed"], r["wall_s"]) for r in result.history]
    assert all(a == 2 for a, _, _ in closes), closes
    assert "announced" in closes[0][1], closes  # the announcement was taken ...
    assert all(s < 30.0 for _, _, s in closes), closes  # ... and held the round no longer than the bound
