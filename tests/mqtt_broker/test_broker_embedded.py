"""The embedded broker (amqtt): its own life cycle and the limits it documents as not enforced.
Access control is covered by test_broker_live.py, which runs against both brokers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from broker_testlib import FEDERATION, connect_probe, start_test_broker, try_connect

from mqtt_broker import BrokerConfig, BrokerError, EmbeddedBroker, add_device, load_credentials, start_broker
from mqtt_broker.embedded import NOT_ENFORCED
from mqtt_broker.state import write_broker_files
from protocol.topics import Topics
from transport.credentials import mqtt_connect_settings

pytestmark = pytest.mark.integration
T = Topics(FEDERATION)


def test_embedded_round_trip_live_add_device_and_stop(tmp_path: Path) -> None:
    broker = start_broker(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path, kind="embedded")
    pid = broker.pid
    try:
        assert broker.kind == "embedded" and broker.is_running()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"mqtt_broker.embedded" in cmdline
        # a device added while it runs is accepted without a restart (the passwd file is re-read)
        dev = add_device(tmp_path, "dev-new")
        coord = connect_probe(load_credentials(tmp_path, "coordinator"))
        probe = connect_probe(dev)
        coord.subscribe(T.all_updates())
        probe.subscribe(T.ack("dev-new"))
        probe.publish(T.update_chunk("dev-new", 0, 0), b"update")
        assert coord.wait_for(lambda ms: [p for _, p, _ in ms] == [b"update"])
        coord.publish(T.ack("dev-new"), b"ack")
        assert probe.wait_for(lambda ms: [p for _, p, _ in ms] == [b"ack"])
        coord.close()
        probe.close()
    finally:
        broker.stop()
    assert not broker.is_running()
    assert not Path(f"/proc/{pid}").exists()
    assert try_connect(mqtt_connect_settings(load_credentials(tmp_path, "coordinator")), timeout=1)[0] is None


def test_embedded_refuses_tls_and_non_loopback(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="TLS"):
        start_broker(BrokerConfig(federation=FEDERATION, tls=True), tmp_path / "a", kind="embedded")
    with pytest.raises(BrokerError, match="loopback"):
        start_broker(BrokerConfig(federation=FEDERATION, host="0.0.0.0"), tmp_path / "b", kind="embedded")
    files = write_broker_files(BrokerConfig(federation=FEDERATION, host="0.0.0.0"), tmp_path / "c")
    with pytest.raises(BrokerError, match="loopback"):
        EmbeddedBroker(files.state_dir)


def test_embedded_does_not_enforce_max_packet_size_as_documented(tmp_path: Path) -> None:
    """Clients must check sizes themselves: the embedded broker passes an oversized packet on."""
    assert any("max_packet_size" in line for line in NOT_ENFORCED)
    rb = start_test_broker(tmp_path, "embedded")
    c = rb.creds
    coord, dev = connect_probe(c["coordinator"]), connect_probe(c["dev-a"])
    try:
        coord.subscribe(T.all_updates())
        big = b"z" * (c["dev-a"].max_packet_size + 4096)
        start = time.monotonic()
        dev.publish(T.update_chunk("dev-a", 0, 0), big, timeout=10)
        assert coord.wait_for(lambda ms: len(ms) == 1 and ms[0][1] == big, timeout=10), time.monotonic() - start
    finally:
        coord.close()
        dev.close()
        rb.broker.stop()


def test_embedded_cuts_the_session_of_a_rotated_password(tmp_path: Path) -> None:
    """Rotating a device's password ends its open session; the old password no longer connects."""
    broker = start_broker(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path, kind="embedded")
    try:
        old = add_device(tmp_path, "dev-r")
        probe = connect_probe(old)
        assert probe.client.is_connected()
        new = add_device(tmp_path, "dev-r", rotate=True)
        deadline = time.monotonic() + 10
        while probe.client.is_connected() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not probe.client.is_connected(), "the rotated device's session is still open"
        probe.close()
        assert try_connect(mqtt_connect_settings(old), timeout=2)[0] not in (None, 0)
        connect_probe(new).close()
    finally:
        broker.stop()


def test_embedded_keeps_a_client_after_a_publish_to_a_dollar_topic(tmp_path: Path) -> None:
    """A PUBLISH to a ``$`` topic is dropped; the client's later publishes are still delivered."""
    broker = start_broker(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path, kind="embedded")
    try:
        dev = add_device(tmp_path, "dev-d")
        coord = connect_probe(load_credentials(tmp_path, "coordinator"))
        coord.subscribe(T.all_updates())
        probe = connect_probe(dev)
        probe.publish("$SYS/junk", b"x")
        probe.publish(T.update_chunk("dev-d", 0, 0), b"after")
        assert coord.wait_for(lambda ms: [p for _, p, _ in ms] == [b"after"], 5)
        probe.close()
        coord.close()
    finally:
        broker.stop()


def test_subscription_snapshot_survives_changes_during_iteration() -> None:
    from mqtt_broker.embedded import _SnapshotDict

    subs = _SnapshotDict({"a": [1], "b": [2]})
    seen = []
    for key, value in subs.items():  # a plain dict raises "dictionary changed size during iteration"
        subs[key + "x"] = value
        seen.append(key)
    for key in subs:
        subs.pop("bx", None)
    assert seen == ["a", "b"] and set(subs) == {"a", "b", "ax"}
