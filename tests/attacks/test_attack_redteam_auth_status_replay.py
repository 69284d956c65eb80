"""A device's own signed statuses, put back on its status topic (docs/explanation/security.md, "Replays").

The coordinator selects among the devices whose statuses say they are online. The adversary is ``mallory``, a
device whose broker account was given a too-broad ACL (read and write on every topic of the federation, as a
mistaken ACL, a bridge or a broker defect would give it); it holds no key but its own, so it cannot make a
status up, but it records what dev-b sends and publishes it again later:

* dev-b loses power (its will reaches the coordinator: offline); mallory puts back dev-b's last heartbeat,
  again and again. On the old code the coordinator took dev-b for online (it would be selected, and every
  round it is in would wait to the deadline for an update that never comes);
* dev-b reboots and is online; mallory puts back the will of its earlier life. On the old code the
  coordinator took the live dev-b for offline.

The guarantee: both are refused (counter ``replayed``), and dev-b's real statuses still count. dev-b is a real
edge client, the coordinator a real one, on a real Mosquitto.
"""

from __future__ import annotations

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


def _state(payload: bytes) -> str:
    msg = decode_message(payload)[1]
    assert isinstance(msg, Status)
    return msg.state


def test_a_devices_earlier_statuses_put_back_are_refused(tmp_path: Path, attack_fed: Any,
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

    def put_back(payload: bytes, times: int = 3) -> None:
        for _ in range(times):
            before = sum(m.payload == payload for m in mallory.messages)
            assert mallory.link.wait_published([mallory.link.publish(T.status("dev-b"), payload, retain=True)], 5)
            mallory.next(lambda e, n=before: sum(m.payload == payload for m in mallory.messages) > n, 5)
            assert sum(m.payload == payload for m in mallory.messages) > before, \
                "the broker did not deliver mallory's copy: the attack was not made"
            time.sleep(0.3)

    try:
        client.start()
        assert until(online, 20), "the coordinator never saw dev-b online"
        heartbeat = mallory.wait_message(lambda m: bool(m.payload) and _state(m.payload) != "offline", 10)
        assert heartbeat is not None
        client.crash()  # a power loss: the broker publishes dev-b's will
        will = mallory.wait_message(lambda m: bool(m.payload) and _state(m.payload) == "offline", 20)
        assert will is not None, "dev-b's will never came"
        assert until(lambda: not online(), 10), "the coordinator did not take dev-b's will"
        refused = coord.counters["replayed"]
        put_back(heartbeat.payload)
        assert not online(), "an old heartbeat put back made the coordinator take the dead dev-b for online"
        assert coord.counters["replayed"] >= refused + 3
        # dev-b reboots (a new instance over the same state folder): online again
        client = EdgeClient(settings, fed.devices["dev-b"], shard)
        client.start()
        assert until(online, 20), "the coordinator did not take the rebooted dev-b's heartbeat"
        refused = coord.counters["replayed"]
        put_back(will.payload)
        assert online(), "the will of dev-b's earlier life put back made the coordinator take it for offline"
        assert coord.counters["replayed"] >= refused + 3
        # positive control: dev-b's own offline status (a clean stop) still counts
        client.stop()
        assert until(lambda: not online(), 10), "dev-b's own offline status was not taken"
    finally:
        client.stop()
        mallory.close()
        coord.stop()
