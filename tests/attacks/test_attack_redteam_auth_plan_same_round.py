"""An earlier plan of the current round, put back (docs/explanation/security.md, "Replays").

The coordinator publishes more than one plan in a round: an asynchronous federation a new one each time its
slots change (a device given a slot is in the new plan's selection), a synchronous one when it extends the
deadline. The adversary is ``mallory``, a device whose broker account was given a too-broad ACL (read and write
on every topic of the federation, as a mistaken ACL, a bridge or a broker defect would give it); it holds no key
but its own. It recorded the round's first plan, which did not select dev-a, and puts it back as the retained
plan after the coordinator gave dev-a a slot: on the old code dev-a took it (same round, so not "older"),
dropped its slot's work and idled while the coordinator held the slot for it. The guarantee: dev-a keeps the
later plan. The test plays the coordinator with its publishing code (coordinator.publish); dev-a is a real
edge client on a real Mosquitto.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from attacklib import until
from fedtestlib import Recorder

from coordinator.publish import Publisher
from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from mqtt_broker import mosquitto_available
from protocol import Plan, Topics

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)


def _plan(selected: tuple[str, ...]) -> Plan:
    return Plan(3, selected, time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100, mode="async",
                max_staleness=2)


def _holds(client: EdgeClient, selected: tuple[str, ...], timeout: float) -> bool:
    return until(lambda: client.plan is not None and client.plan.selected == selected, timeout)


def test_an_earlier_plan_of_the_round_put_back_is_refused(tmp_path: Path, attack_fed: Any,
                                                          digits_shard: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b"], federation=FED)  # mallory, the mistaken ACL
    shard = digits_shard(0)
    coord = Recorder(fed.coordinator)
    publisher = Publisher(coord.link, T, "coordinator", fed.coordinator.max_payload, tmp_path, 5.0,
                          lambda: False, key=fed.coordinator.signer())
    mallory = fed.listen([T.round()])
    settings = EdgeSettings(state_dir=str(tmp_path / "dev-a"), client_index=0, device="cpu", heartbeat_s=2.0)
    client = EdgeClient(settings, fed.devices["dev-a"], shard)
    client.start()
    try:
        publisher.plan(_plan(("dev-b",)))  # the round opens without dev-a
        first = mallory.wait_message(lambda m: bool(m.payload), 10)
        assert first is not None, "mallory did not read the round's first plan"
        assert _holds(client, ("dev-b",), 10), "dev-a did not take the round's first plan"
        publisher.plan(_plan(("dev-a", "dev-b")))  # a slot for dev-a
        assert _holds(client, ("dev-a", "dev-b"), 10), "dev-a did not take the plan that gave it a slot"
        before = sum(m.payload == first.payload for m in mallory.messages)
        assert mallory.link.wait_published([mallory.link.publish(T.round(), first.payload, retain=True)], 5)
        mallory.next(lambda e: sum(m.payload == first.payload for m in mallory.messages) > before, 5)
        assert sum(m.payload == first.payload for m in mallory.messages) > before, \
            "the broker did not deliver mallory's copy: the attack was not made"
        time.sleep(1.0)
        assert client.plan is not None and client.plan.selected == ("dev-a", "dev-b"), \
            f"dev-a took the round's earlier plan again (selected {client.plan.selected if client.plan else None})"
        # positive control: the coordinator's next plan of the round is taken
        publisher.plan(_plan(("dev-a",)))
        assert _holds(client, ("dev-a",), 10), "dev-a did not take the coordinator's next plan of the round"
    finally:
        client.stop()
        coord.close()
        mallory.close()
