"""A revoked or re-keyed device under ``flayer broker start --tls --identity-as-username`` (docs/explanation/
guarantees.md, "Who may read and write what on the broker"; docs/howto/devices.md, "Revoke a device").

In this mode the broker asks no password: the client certificate's CN is the username and so the client id.
The adversary is a device with its own kit (its copy of the client certificate and key, unpacked where it
runs), connected to a real Mosquitto over TLS when the operator runs ``flayer broker revoke`` or ``flayer
broker add-device --rotate``. It keeps its open connection and publishes on it, then connects again with its
kit, as a stolen or copied device would. The guarantee holds when its open connection is closed, what it
publishes afterwards reaches no subscriber, its new connection is refused (its certificate is on the
federation's revocation list), and -- after a rotation -- the new kit's connection stays up: the old kit can
neither connect nor take the client id over. Another device is unaffected (the positive control).

The Aedes cluster (``--cluster``, passwords only) is attacked the same way with a rotation: the copied kit's
open connection must close once the device's password entry is replaced.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cli.main import main as flayer
from mqtt_broker import BrokerConfig, add_device, load_credentials
from mqtt_broker.cluster import cluster_missing, start_cluster
from mqtt_broker.kit import write_kit
from protocol.topics import Topics
from tests.mqtt_broker.broker_testlib import (
    DEVICES,
    FEDERATION,
    NEGATIVE_WINDOW_S,
    Probe,
    connect_probe,
    needs_mosquitto,
    try_connect,
)
from transport.credentials import Credentials, mqtt_connect_settings
from transport.kit import unpack_kit

T = Topics(FEDERATION)
CLUSTER_MISSING = cluster_missing()


def _own_kit(state_dir: Path, device: str, where: Path) -> Credentials:
    """The device's kit as the device holds it: written by the operator, unpacked on the device's machine."""
    kit = write_kit(state_dir, device, where / f"{device}.tar.gz")
    return Credentials.load(unpack_kit(kit, where / device).parent / "credentials.toml")


def _as_device(creds: Credentials) -> Probe:
    """Connected over TLS with the kit's certificate (what ``flayer edge --kit`` does)."""
    return connect_probe(creds, use_tls=True)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = flayer(list(argv))
    return rc, out.getvalue()


def _closed(probe: Probe, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while probe.client.is_connected() and time.monotonic() < end:
        time.sleep(0.05)
    return not probe.client.is_connected()


@needs_mosquitto
def test_a_revoked_identity_is_cut_off_and_its_kit_refused(tmp_path: Path, attack_fed: Any) -> None:
    rb = attack_fed(DEVICES, adversary="dev-a", view="device", federation=FEDERATION, tls=True,
                    use_identity_as_username=True)
    probes: list[Probe] = []
    try:
        kit = _own_kit(rb.files.state_dir, "dev-a", tmp_path / "device")
        coord = connect_probe(rb.creds["coordinator"])
        probes.append(coord)
        coord.subscribe("fl/#")
        a = _as_device(kit)
        b = _as_device(rb.creds["dev-b"])
        probes += [a, b]
        a.publish(T.status("dev-a"), b"online before")
        assert coord.wait_for(lambda ms: any(p == b"online before" for _, p, _ in ms), 5)

        rc, said = _cli("broker", "revoke", "dev-a", "--state-dir", str(rb.files.state_dir))
        assert rc == 0
        assert _closed(a), f"the revoked device's open TLS connection survived the revocation (CLI said: {said!r})"
        assert "closed any open TLS connection of dev-a" in said
        a.client.publish(T.status("dev-a"), b"after revoke", qos=1)  # whatever still goes out
        again, client = try_connect(mqtt_connect_settings(kit, use_tls=True))
        client.loop_stop()
        assert again is None, f"the revoked device's kit connected again (CONNACK {again})"
        b.publish(T.status("dev-b"), b"still enrolled")  # the positive control
        assert coord.wait_for(lambda ms: any(p == b"still enrolled" for _, p, _ in ms), 5)
        time.sleep(NEGATIVE_WINDOW_S)
        assert [m for m in coord.messages if m[1] == b"after revoke"] == []
    finally:
        for p in probes:
            p.close()


@needs_mosquitto
def test_a_copied_old_kit_cannot_undo_a_rotation(tmp_path: Path, attack_fed: Any) -> None:
    rb = attack_fed(DEVICES, adversary="dev-a", view="device", federation=FEDERATION, tls=True,
                    use_identity_as_username=True)
    probes: list[Probe] = []
    try:
        old_kit = _own_kit(rb.files.state_dir, "dev-a", tmp_path / "copied")
        coord = connect_probe(rb.creds["coordinator"])
        probes.append(coord)
        coord.subscribe("fl/#")
        old = _as_device(old_kit)
        probes.append(old)

        rc, said = _cli("broker", "add-device", "dev-a", "--rotate", "--state-dir", str(rb.files.state_dir))
        assert rc == 0
        assert _closed(old), f"the old kit's open connection survived the rotation (CLI said: {said!r})"
        new_kit = _own_kit(rb.files.state_dir, "dev-a", tmp_path / "new")
        new = _as_device(new_kit)
        probes.append(new)
        # the copied old kit tries to come back, which with the same client id would knock the new kit off
        for _ in range(3):
            again, client = try_connect(mqtt_connect_settings(old_kit, use_tls=True))
            client.loop_stop()
            assert again is None, f"the old kit connected after the rotation (CONNACK {again})"
        time.sleep(NEGATIVE_WINDOW_S)
        assert new.client.is_connected(), "the old kit took the client id over from the new kit"
        new.publish(T.status("dev-a"), b"new kit")
        assert coord.wait_for(lambda ms: any(p == b"new kit" for _, p, _ in ms), 5)
        # the old certificate is refused whatever client id it asks for
        other, client = try_connect(replace(mqtt_connect_settings(old_kit, use_tls=True), client_id="someone-else"))
        client.loop_stop()
        assert other is None, f"the old certificate connected under another client id (CONNACK {other})"
    finally:
        for p in probes:
            p.close()


@pytest.mark.skipif(CLUSTER_MISSING is not None, reason=f"no broker cluster here: {CLUSTER_MISSING}")
def test_a_copied_old_kit_is_cut_off_the_aedes_cluster_by_a_rotation(tmp_path: Path) -> None:
    """The same copied kit against ``flayer broker start --cluster 2`` (passwords, no TLS): its open connection
    must close when the device's password is rotated, and nothing it publishes after that gets through."""
    state = tmp_path / "broker"
    cluster = start_cluster(BrokerConfig(federation=FEDERATION, persistence=False), state, 2)
    probes: list[Probe] = []
    try:
        add_device(state, "dev-a")
        cluster.reload()
        old_kit = _own_kit(state, "dev-a", tmp_path / "copied")
        coord = connect_probe(load_credentials(state, "coordinator"))
        probes.append(coord)
        coord.subscribe("fl/#")
        old = connect_probe(old_kit)
        probes.append(old)
        old.publish(T.status("dev-a"), b"online before")
        assert coord.wait_for(lambda ms: any(p == b"online before" for _, p, _ in ms), 5)

        rc, said = _cli("broker", "add-device", "dev-a", "--rotate", "--state-dir", str(state))
        assert rc == 0 and "reloaded the running broker cluster" in said
        old.client.publish(T.status("dev-a"), b"old kit after rotation", qos=1)
        assert _closed(old), "the copied old kit's open connection survived the rotation on the cluster"
        again, client = try_connect(mqtt_connect_settings(old_kit))
        client.loop_stop()
        assert again not in (0, None), f"the old kit connected again after the rotation (CONNACK {again})"
        new = connect_probe(load_credentials(state, "dev-a"))  # the positive control: the new password
        probes.append(new)
        new.publish(T.status("dev-a"), b"new kit")
        assert coord.wait_for(lambda ms: any(p == b"new kit" for _, p, _ in ms), 5)
        time.sleep(NEGATIVE_WINDOW_S)
        assert [m for m in coord.messages if m[1] == b"old kit after rotation"] == []
    finally:
        for p in probes:
            p.close()
        cluster.stop()
