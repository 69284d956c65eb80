"""A device revoked while connected (docs/explanation/guarantees.md, "Who may read and write what on the broker";
docs/explanation/security.md, "What is not protected": ``flayer broker revoke``).

The adversary is a device whose kit the operator revoked (a stolen or retired device): it keeps the
credentials file it was given and holds an open connection to a real Mosquitto when the revocation and the
broker's reload happen. It then publishes an update on its open connection and tries to connect again with
the same credentials. The guarantee holds when its open connection is closed by the reload, nothing it
publishes afterwards reaches the coordinator (subscribed to every topic of the federation), and its new
connection is refused, while another device is unaffected. The same when the operator's ``flayer broker revoke``
cannot write its output (a closed pipe): the broker is told before anything is printed.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

from cli.main import main as flayer
from mqtt_broker.kit import revoke_device
from protocol.topics import Topics
from tests.mqtt_broker.broker_testlib import (
    DEVICES,
    FEDERATION,
    NEGATIVE_WINDOW_S,
    connect_probe,
    needs_mosquitto,
    try_connect,
)
from transport.credentials import mqtt_connect_settings

pytestmark = needs_mosquitto
T = Topics(FEDERATION)


def test_a_revoked_device_is_cut_off_and_refused(tmp_path: Path, attack_fed: Any) -> None:
    rb = attack_fed(DEVICES, adversary="dev-a", view="device", federation=FEDERATION)
    probes = []
    try:
        coord = connect_probe(rb.coordinator)
        a = connect_probe(rb.devices["dev-a"])
        b = connect_probe(rb.devices["dev-b"])
        probes += [coord, a, b]
        coord.subscribe("fl/#")
        a.publish(T.update_chunk("dev-a", 1, 0), b"before")
        assert coord.wait_for(lambda ms: (T.update_chunk("dev-a", 1, 0), b"before") in {m[:2] for m in ms}, 5)

        assert revoke_device(rb.state_dir, "dev-a")
        rb.broker.reload()
        end = time.monotonic() + 5
        while a.client.is_connected() and time.monotonic() < end:
            time.sleep(0.05)
        assert not a.client.is_connected(), "the revoked device's open connection survived the reload"
        a.client.publish(T.update_chunk("dev-a", 2, 0), b"after revoke", qos=1)  # whatever still goes out
        rc, again = try_connect(mqtt_connect_settings(rb.devices["dev-a"]))
        again.loop_stop()
        assert rc not in (0, None), f"the revoked device connected again (CONNACK {rc})"
        b.publish(T.update_chunk("dev-b", 2, 0), b"still enrolled")  # the positive control
        assert coord.wait_for(lambda ms: (T.update_chunk("dev-b", 2, 0), b"still enrolled") in {m[:2] for m in ms}, 5)
        time.sleep(NEGATIVE_WINDOW_S)
        assert [m for m in coord.messages if m[1] == b"after revoke"] == []
    finally:
        for p in probes:
            p.close()


class _BrokenStdout(io.TextIOBase):
    """The operator's terminal or pipe gone: every write fails, as on a pipe whose reader has left."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_revoke_cuts_the_device_off_even_when_its_output_cannot_be_written(tmp_path: Path,
                                                                           attack_fed: Any) -> None:
    """``flayer broker revoke`` whose stdout fails (a closed pipe or terminal): the broker is told first, so the
    revoked device's open connection is closed all the same (before, it printed first and stopped there)."""
    rb = attack_fed(DEVICES, adversary="dev-a", view="device", federation=FEDERATION)
    probes = []
    try:
        a = connect_probe(rb.devices["dev-a"])
        probes.append(a)
        with contextlib.redirect_stdout(_BrokenStdout()), contextlib.suppress(BrokenPipeError):
            flayer(["broker", "revoke", "dev-a", "--state-dir", str(rb.state_dir)])
        end = time.monotonic() + 5
        while a.client.is_connected() and time.monotonic() < end:
            time.sleep(0.05)
        assert not a.client.is_connected(), "the revoke whose output failed left the device connected"
        rc, again = try_connect(mqtt_connect_settings(rb.devices["dev-a"]))
        again.loop_stop()
        assert rc not in (0, None), f"the revoked device connected again (CONNACK {rc})"
    finally:
        for p in probes:
            p.close()
