"""A revoked device is never selected (docs/howto/devices.md, "Rotate or shut out a device"; the security
model: revoked, a device is never selected, its messages dropped).

dev-c is online, its status taken by the coordinator, when the operator revokes it with ``flayer broker
revoke`` while the coordinator runs. The adversary is whoever still speaks for dev-c: a party with a too-broad
ACL (read and write on every topic of the federation, as a mistaken ACL, a bridge or a broker defect would give
it) puts dev-c's signed heartbeat back after the revocation. The coordinator must not count dev-c among the
devices online: with two needed to open a round, dev-b alone opens none, and the round that opens once dev-a
comes selects dev-a and dev-b only. A real coordinator on a real Mosquitto.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from attacklib import widen_acl
from fedtestlib import Recorder

from mqtt_broker import mosquitto_available
from mqtt_broker.kit import revoke_device
from protocol import Plan, Status, Topics, decode_message, encode_message

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]
FED = "itest"
T = Topics(FED)


def _online(rec: Recorder, device: str, key: object) -> bytes:
    payload = encode_message(Status(0, "online", time.time()), FED, device, key=key)
    assert rec.link.wait_published([rec.link.publish(T.status(device), payload)], 5)
    return payload


def test_a_device_revoked_while_online_is_never_selected(tmp_path: Path, attack_fed: Any) -> None:
    fed = attack_fed(["dev-a", "dev-b", "dev-c"], federation=FED)  # mallory, the mistaken ACL
    coord = fed.coordinator_in(strategy="fedavg", rounds=1, dataset="digits", quorum=2, min_devices=2,
                               deadline_s=60.0)
    c = Recorder(fed.devices["dev-c"])
    watcher = Recorder(fed.devices["dev-b"], [T.round()])
    try:
        heartbeat = _online(c, "dev-c", fed.devices["dev-c"].signer())
        deadline = time.monotonic() + 20
        while not coord.registry.is_online("dev-c", time.time()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.registry.is_online("dev-c", time.time()), "the coordinator never saw dev-c online"
        assert revoke_device(fed.state_dir, "dev-c")  # the operator shuts dev-c out
        widen_acl(fed, "mallory")  # (revoking rewrites the ACL: the mistaken rule goes back in)
        mallory = fed.listen([T.status("dev-c")])
        try:
            assert mallory.link.wait_published([mallory.link.publish(T.status("dev-c"), heartbeat)], 5)
            assert mallory.wait_message(lambda m: m.payload == heartbeat, 5) is not None, \
                "the broker did not deliver dev-c's heartbeat: the attack was not made"
        finally:
            mallory.close()
        _online(watcher, "dev-b", fed.devices["dev-b"].signer())
        early = watcher.wait_message(lambda m: bool(m.payload), 4)
        assert early is None, f"a round opened with dev-b and the revoked dev-c: {decode_message(early.payload)[1]}"
        a = Recorder(fed.devices["dev-a"])
        try:
            _online(a, "dev-a", fed.devices["dev-a"].signer())
            msg = watcher.wait_message(lambda m: bool(m.payload), 30)
        finally:
            a.close()
        assert msg is not None, "no round opened with dev-a and dev-b online"
        plan = decode_message(msg.payload)[1]
        assert isinstance(plan, Plan) and set(plan.selected) == {"dev-a", "dev-b"}, plan.selected
    finally:
        c.close()
        watcher.close()
        coord.stop()
