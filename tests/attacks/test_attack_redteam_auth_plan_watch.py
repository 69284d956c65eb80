"""The emulator's plan watch believes only the coordinator's plans (docs/explanation/security.md).

The emulator's launcher watches the round plan through a monitor connection, and at the ``final`` plan tells
every worker of its shard to wrap up: what it reads stops every emulated device. The adversary is ``mallory``,
a device whose broker account was given a too-broad ACL (read and write on every topic of the federation, as
a mistaken ACL, a bridge or a broker defect would give it). It holds its own signing key and whatever it read,
never the coordinator's. It publishes a ``final`` plan on the plan topic, live and retained, unsigned and
signed with its own key: the watch must not take it as the end of the run. The genuine coordinator's final
plan (the test plays the coordinator) still ends it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fedtestlib import Recorder

from emulator.plan_watch import PlanWatch
from mqtt_broker import mosquitto_available
from protocol import Plan, Topics, encode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)


def _plan(round_: int, phase: str) -> Plan:
    return Plan(round_, ("dev-a",), time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100,
                phase=phase, rounds=3)


def _settle(watch: PlanWatch, until: float) -> None:
    while time.monotonic() < until:
        watch.poll()
        time.sleep(0.05)


def test_a_final_plan_the_coordinator_did_not_sign_does_not_wrap_the_fleet_up(attack_fed: Any) -> None:
    fed = attack_fed(["dev-a", "emu-monitor-0"], federation=FED)  # mallory, the mistaken ACL
    mallory = fed.listen([T.round()])
    watch = PlanWatch(fed.devices["emu-monitor-0"]).start()
    coord = Recorder(fed.coordinator)
    try:
        _settle(watch, time.monotonic() + 1.0)
        # a genuine training plan first: the watch is live and believes the coordinator
        genuine = encode_message(_plan(1, "train"), FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), genuine, retain=True)], 5)
        deadline = time.monotonic() + 10
        while not watch.seen_train and time.monotonic() < deadline:
            watch.poll()
            time.sleep(0.05)
        assert watch.seen_train, "the watch did not take the coordinator's training plan"
        mallory_key = fed.devices["mallory"].signer()
        for key in (None, mallory_key):
            for retain in (False, True):
                forged = encode_message(_plan(2, "final"), FED, "coordinator", key=key)
                before = watch.refused
                assert mallory.link.wait_published([mallory.link.publish(T.round(), forged, retain=retain)], 5)
                assert mallory.wait_message(lambda m, f=forged: m.payload == f, 5) is not None, \
                    "the broker did not deliver mallory's plan: the attack was not made"
                deadline = time.monotonic() + 5
                while watch.refused == before and not watch.final_seen and time.monotonic() < deadline:
                    watch.poll()
                    time.sleep(0.05)
                assert not watch.final_seen, \
                    f"a final plan {'signed by mallory' if key else 'unsigned'} (retain={retain}) wrapped the fleet up"
                assert watch.refused == before + 1, "the watch never received mallory's plan"
        # positive control: the coordinator's own final plan ends the run
        final = encode_message(_plan(3, "final"), FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), final, retain=True)], 5)
        deadline = time.monotonic() + 10
        while not watch.final_seen and time.monotonic() < deadline:
            watch.poll()
            time.sleep(0.05)
        assert watch.final_seen, "the coordinator's final plan did not end the run"
    finally:
        watch.stop()
        mallory.close()
        coord.close()
