"""A signed plan of an earlier round, replayed to a device that rebooted (docs/explanation/security.md,
"Replays": a device's rounds only move forward, including after a restart).

The adversary is ``mallory``, a device whose broker account was given a too-broad ACL (read and write on every
topic of the federation, as a mistaken ACL, a bridge or a broker defect would give it); it holds no key but its
own. It recorded the coordinator's signed plan of round 4, which selected dev-a. dev-a was not selected in
round 5 (so it trained nothing past round 3), took that plan, and rebooted. Mallory puts the round-4 plan back
as the retained plan: on the old code the rebooted dev-a, which remembered only the rounds it trained, took it,
downloaded round 4's model and trained for a round long closed. The guarantee: it refuses the plan, and still
takes the coordinator's next one. The test plays the coordinator; dev-a is a real edge client on a real
Mosquitto.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from attacklib import until
from fedtestlib import Recorder

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore, StoredState
from mqtt_broker import mosquitto_available
from protocol import Plan, Topics, encode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)


def _plan(round_: int, selected: tuple[str, ...]) -> Plan:
    return Plan(round_, selected, time.time() + 600, "fedavg", {}, {"name": "mlp"}, f"{round_:02d}" * 32, 1, 100)


def _took(client: EdgeClient, round_: int, timeout: float) -> bool:
    return until(lambda: client.plan is not None and client.plan.round == round_, timeout)


def test_an_earlier_rounds_plan_replayed_after_a_reboot_is_refused(tmp_path: Path, attack_fed: Any,
                                                                    digits_shard: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b"], federation=FED)  # mallory, the mistaken ACL
    shard = digits_shard(0)
    key = fed.coordinator.signer()
    state = tmp_path / "dev-a"
    DeviceStore(state).save(StoredState(None, 3, None, False, {}))  # dev-a trained up to round 3
    settings = EdgeSettings(state_dir=str(state), client_index=0, device="cpu", heartbeat_s=2.0)
    coord = Recorder(fed.coordinator)
    mallory = fed.listen([T.round()])
    recorded = encode_message(_plan(4, ("dev-a",)), FED, "coordinator", key=key)  # what mallory kept of round 4
    client = EdgeClient(settings, fed.devices["dev-a"], shard)
    client.start()
    try:
        live = encode_message(_plan(5, ("dev-b",)), FED, "coordinator", key=key)
        assert coord.link.wait_published([coord.link.publish(T.round(), live, retain=True)], 5)
        assert _took(client, 5, 15), "dev-a did not take the coordinator's plan of round 5"
        client.stop()  # the reboot
        assert mallory.link.wait_published([mallory.link.publish(T.round(), recorded, retain=True)], 5)
        assert mallory.wait_message(lambda m: m.payload == recorded, 5) is not None, \
            "the broker did not deliver mallory's plan: the attack was not made"
        client = EdgeClient(settings, fed.devices["dev-a"], shard)
        client.start()
        time.sleep(2.0)  # the retained plan reaches it at once
        assert client.error is None
        assert client.plan is None, f"the rebooted dev-a took the replayed plan of round {client.plan.round}"
        assert client._download is None, "the rebooted dev-a fetched the replayed round's model"
        # positive control: the coordinator's next plan is taken
        nxt = encode_message(_plan(6, ("dev-b",)), FED, "coordinator", key=key)
        assert coord.link.wait_published([coord.link.publish(T.round(), nxt, retain=True)], 5)
        assert _took(client, 6, 15), "the rebooted dev-a did not take the coordinator's plan of round 6"
    finally:
        client.stop()
        coord.close()
        mallory.close()
