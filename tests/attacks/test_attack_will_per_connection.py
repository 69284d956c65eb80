"""The will of a device's earlier connection, put back while the same device process lives (docs/explanation/
security.md, "Replays"; docs/explanation/guarantees.md).

The adversary is ``mallory``, a device whose broker account was given a too-broad ACL (read and write on every
topic of the federation: a mistaken ACL, a bridge, a broker defect); it holds no key but its own. dev-b, a real
edge client, loses its link once (the socket is cut; the process keeps running and paho reconnects by itself),
so the broker publishes dev-b's will and mallory records it. From then on, each time dev-b's heartbeat arrives,
mallory puts that will back on dev-b's status topic. On the old code the will was signed once per process and
paho sent the same one with every CONNECT, so the coordinator took it for the will of dev-b's current
connection: dev-b looked offline most of the time (not selected), and counter ``replayed`` stayed 0.

The guarantee: each connection carries its own signed will, the heartbeats after it name it, and a will of an
earlier connection is refused (counter ``replayed``); dev-b stays online. dev-b's own offline status (a clean
stop) still counts (the positive control). A real coordinator, a real Mosquitto.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
from attacklib import until

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from mqtt_broker import mosquitto_available
from protocol import Status, Topics, decode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)
PUT_BACKS = 5


def _status(payload: bytes) -> Status | None:
    msg = decode_message(payload)[1] if payload else None
    return msg if isinstance(msg, Status) else None


def test_the_will_of_an_earlier_connection_is_refused(tmp_path: Path, attack_fed: Any,
                                                      digits_shard: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b"], federation=FED)  # mallory, the mistaken ACL
    shard = digits_shard(1)
    coord = fed.coordinator_in(strategy="fedavg", rounds=1, dataset="digits", min_devices=3, quorum=2,
                               deadline_s=60.0)  # no round opens: only dev-b is ever online
    mallory = fed.listen([T.status("dev-b")])
    settings = EdgeSettings(state_dir=str(tmp_path / "dev-b"), client_index=1, device="cpu", heartbeat_s=1.0)
    client = EdgeClient(settings, fed.devices["dev-b"], shard)

    def online() -> bool:
        return coord.registry.is_online("dev-b", time.time())

    def seen(pred: Any, timeout: float) -> bool:
        """Until ``pred()`` holds of what mallory has received (its events drained as they come)."""
        deadline = time.monotonic() + timeout
        while not pred() and time.monotonic() < deadline:
            mallory.next(lambda e: True, 0.05)
        return bool(pred())

    def states(state: str) -> list[bytes]:
        return [m.payload for m in mallory.messages if (s := _status(m.payload)) is not None and
                (s.state == "offline") == (state == "offline")]

    try:
        client.start()
        assert until(online, 20), "the coordinator never saw dev-b online"
        sock = client.link.client.socket()
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)  # the link is cut; the process lives on and paho reconnects
        assert mallory.wait_message(lambda m: (s := _status(m.payload)) is not None and s.state == "offline", 20), \
            "dev-b's will never came"
        will = states("offline")[-1]
        assert until(lambda: client.link.connected.is_set() and online(), 20), "dev-b did not come back online"
        refused = coord.counters["replayed"]
        samples = []
        for _ in range(PUT_BACKS):
            before = len(states("online"))  # right after the next heartbeat, the earlier will again
            assert seen(lambda n=before: len(states("online")) > n, 5), "dev-b's heartbeats stopped"
            delivered = sum(p == will for p in states("offline"))
            assert mallory.link.wait_published([mallory.link.publish(T.status("dev-b"), will, retain=True)], 5)
            assert seen(lambda n=delivered: sum(p == will for p in states("offline")) > n, 5), \
                "the broker did not deliver mallory's copy: the attack was not made"
            time.sleep(0.3)  # the coordinator has it too (same broker, same topic); the next heartbeat is ~0.7 s off
            samples.append(online())
        assert coord.counters["replayed"] >= refused + PUT_BACKS, \
            f"the earlier will was taken {PUT_BACKS - (coord.counters['replayed'] - refused)} time(s), not refused"
        assert all(samples), f"dev-b shown offline after {samples.count(False)} of {PUT_BACKS} put-backs"
        # positive control: dev-b's own offline status (a clean stop) still counts
        client.stop()
        assert until(lambda: not online(), 10), "dev-b's own offline status was not taken"
    finally:
        client.stop()
        mallory.close()
        coord.stop()
