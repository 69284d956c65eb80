"""A copied old kit after ``flayer broker add-device ID --rotate``, where the broker asks a password
(docs/explanation/guarantees.md, "Who may read and write what on the broker"; docs/howto/devices.md, "Rotate or
shut out a device").

The adversary holds a copy of a device's kit made before the rotation (a lost or copied kit: the reason to
rotate) and is connected with it when the operator rotates. The guarantee holds, on Mosquitto and on the
embedded broker, when its open connection is closed at the reload, what it publishes afterwards reaches no
subscriber, it cannot connect again, and the new kit connects. (TLS with identity as username and the Aedes
cluster: tests/attacks/test_attack_revoked_identity.py.)
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

import pytest

from cli.main import main as flayer
from mqtt_broker.kit import write_kit
from protocol.topics import Topics
from tests.mqtt_broker.broker_testlib import (
    DEVICES,
    FEDERATION,
    NEGATIVE_WINDOW_S,
    connect_probe,
    mosquitto_available,
    try_connect,
)
from transport.credentials import Credentials, mqtt_connect_settings
from transport.kit import unpack_kit

T = Topics(FEDERATION)


def _embedded_available() -> bool:
    try:
        import amqtt  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("kind", [
    pytest.param("mosquitto", marks=pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")),
    pytest.param("embedded", marks=pytest.mark.skipif(not _embedded_available(), reason="amqtt is not installed")),
])
def test_a_copied_old_kit_is_cut_off_by_a_rotation(tmp_path: Path, kind: str, attack_fed: Any) -> None:
    rb = attack_fed(DEVICES, adversary="dev-a", view="device", federation=FEDERATION, kind=kind)
    probes = []
    try:
        kit = write_kit(rb.files.state_dir, "dev-a", tmp_path / "dev-a.tar.gz")
        old_kit = Credentials.load(unpack_kit(kit, tmp_path / "copied").parent / "credentials.toml")
        coord = connect_probe(rb.creds["coordinator"])
        old = connect_probe(old_kit)
        probes += [coord, old]
        coord.subscribe("fl/#")
        old.publish(T.status("dev-a"), b"before")
        assert coord.wait_for(lambda ms: any(p == b"before" for _, p, _ in ms), 5)

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert flayer(["broker", "add-device", "dev-a", "--rotate", "--state-dir", str(rb.files.state_dir)]) == 0
        end = time.monotonic() + 5
        while old.client.is_connected() and time.monotonic() < end:
            time.sleep(0.05)
        assert not old.client.is_connected(), f"the copied old kit's connection survived the rotation ({kind})"
        old.client.publish(T.status("dev-a"), b"old kit after rotation", qos=1)
        again, client = try_connect(mqtt_connect_settings(old_kit))
        client.loop_stop()
        assert again not in (0, None), f"the copied old kit connected again (CONNACK {again})"
        new = connect_probe(Credentials.load(rb.files.credentials("dev-a")))  # the positive control
        probes.append(new)
        new.publish(T.status("dev-a"), b"new kit")
        assert coord.wait_for(lambda ms: any(p == b"new kit" for _, p, _ in ms), 5)
        time.sleep(NEGATIVE_WINDOW_S)
        assert [m for m in coord.messages if m[1] == b"old kit after rotation"] == []
    finally:
        for p in probes:
            p.close()
