"""What ``flayer status`` and the dashboard show as the round plan is the coordinator's
(docs/explanation/security.md, "Watchers").

``flayer status`` reports "federation finished" and exits with the stopped-fleet code when the plan it reads is
a ``final`` one and no device is online; a script watching a fleet acts on that. The adversary is ``mallory``,
a device whose broker account was given a too-broad ACL (read and write on every topic of the federation, as a
mistaken ACL, a bridge or a broker defect would give it); it holds no key but its own. It publishes a final
plan, unsigned and signed with its own key: the observer's view must keep the coordinator's training plan.
A real Mosquitto, the observer's own credentials.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from attacklib import until
from fedtestlib import Recorder

from coordinator.dashboard.watch import FleetWatch
from mqtt_broker import load_credentials, mosquitto_available
from protocol import Plan, Topics, encode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)


def _plan(round_: int, phase: str) -> Plan:
    return Plan(round_, ("dev-a",), time.time() + 600, "fedavg", {}, {"name": "mlp"}, "ab" * 32, 1, 100,
                phase=phase, rounds=3)


def _phase(watch: FleetWatch) -> str | None:
    return watch.snapshot()["progress"]["phase"]


def test_a_final_plan_the_coordinator_did_not_sign_is_not_shown(attack_fed: Any) -> None:
    fed = attack_fed(["dev-a"], federation=FED)  # mallory, the mistaken ACL
    coord = Recorder(fed.coordinator)
    mallory = fed.listen([T.round()])
    watch = FleetWatch(load_credentials(fed.state_dir, "observer"), None).start()
    try:
        train = encode_message(_plan(2, "train"), FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), train, retain=True)], 5)
        assert until(lambda: _phase(watch) == "train", 15), "the observer did not show the coordinator's plan"
        for key in (None, fed.devices["mallory"].signer()):
            forged = encode_message(_plan(3, "final"), FED, "coordinator", key=key)
            refused = watch.refused
            assert mallory.link.wait_published([mallory.link.publish(T.round(), forged, retain=True)], 5)
            assert mallory.wait_message(lambda m, f=forged: m.payload == f, 5) is not None, \
                "the broker did not deliver mallory's plan: the attack was not made"
            until(lambda r=refused: watch.refused > r or _phase(watch) != "train", 5)
            assert _phase(watch) == "train", \
                f"a final plan {'signed by mallory' if key else 'unsigned'} was shown as the federation's end"
            assert watch.refused > refused, "the observer never received mallory's plan"
        # positive control: the coordinator's own final plan is shown
        final = encode_message(_plan(3, "final"), FED, "coordinator", key=fed.coordinator.signer())
        assert coord.link.wait_published([coord.link.publish(T.round(), final, retain=True)], 5)
        assert until(lambda: _phase(watch) == "final", 15), "the coordinator's final plan was not shown"
    finally:
        watch.stop()
        coord.close()
        mallory.close()
