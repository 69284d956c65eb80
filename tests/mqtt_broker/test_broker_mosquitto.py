"""Mosquitto-specific behaviour: reload after add-device, packet-size limit, persistence, the
launcher's error paths and its PID discipline."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from broker_testlib import (
    FEDERATION,
    NEGATIVE_WINDOW_S,
    connect_probe,
    needs_mosquitto,
    try_connect,
    wait_connectable,
)

from mqtt_broker import BrokerConfig, BrokerError, BrokerProcess, add_device, start_broker, stop_recorded
from mqtt_broker.fsutil import free_port
from mqtt_broker.passwords import hash_password, set_passwd_entry
from mqtt_broker.process import recorded_process
from mqtt_broker.state import write_broker_files
from protocol.topics import Topics
from transport.credentials import Credentials, mqtt_connect_settings

pytestmark = [pytest.mark.integration, needs_mosquitto]
T = Topics(FEDERATION)


@pytest.fixture()
def mosq(tmp_path):  # type: ignore[no-untyped-def]
    broker = start_broker(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path, kind="mosquitto")
    yield broker
    broker.stop()


def test_new_device_is_refused_until_the_broker_reloads(mosq, tmp_path) -> None:  # type: ignore[no-untyped-def]
    creds = add_device(tmp_path, "dev-late")
    rc, _ = try_connect(mqtt_connect_settings(creds))
    assert rc not in (0, None)  # Mosquitto has not re-read its password file yet
    mosq.reload()
    wait_connectable(creds)


def test_a_python_made_hash_is_accepted_by_mosquitto(mosq, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The fallback hash (used where mosquitto_passwd is missing) has Mosquitto's format."""
    coord = Credentials.load(tmp_path / "credentials" / "coordinator.toml")
    set_passwd_entry(tmp_path / "passwd", "dev-py", hash_password("dev-py", "py-secret", tmp_path, use_mosquitto_passwd=False))
    mosq.reload()
    creds = replace(coord, role="device", username="dev-py", password="py-secret")
    wait_connectable(creds)
    assert try_connect(mqtt_connect_settings(replace(creds, password="py-secreT")))[0] != 0


def test_payload_at_the_limit_passes_and_an_oversized_packet_disconnects(mosq, tmp_path) -> None:  # type: ignore[no-untyped-def]
    coord = Credentials.load(tmp_path / "credentials" / "coordinator.toml")
    dev = add_device(tmp_path, "d" * 64)  # the longest id makes the longest update topic
    mosq.reload()
    wait_connectable(dev)
    reader, writer = connect_probe(coord), connect_probe(dev)
    try:
        reader.subscribe(T.all_updates())
        topic = T.update_chunk(dev.username, 10**12 - 1, 10**12 - 1)
        writer.publish(topic, b"x" * dev.max_payload)
        assert reader.wait_for(lambda ms: len(ms) == 1 and len(ms[0][1]) == dev.max_payload, timeout=5)
        # one byte over the packet size: Mosquitto drops the connection, nothing is delivered
        disconnected = []
        writer.client.on_disconnect = lambda *a: disconnected.append(a[3])
        writer.client.publish(topic, b"y" * (dev.max_packet_size - len(topic) + 1), qos=1)
        deadline = time.monotonic() + 5
        while not disconnected and time.monotonic() < deadline:
            time.sleep(0.02)
        writer.client.loop_stop()  # paho would reconnect and re-send the same packet forever
        assert disconnected, "the oversized publish did not cost the connection"
        reader.wait_for(lambda ms: False, timeout=NEGATIVE_WINDOW_S)
        assert len(reader.messages) == 1
    finally:
        writer.client.disconnect()
        reader.close()


def test_retained_model_survives_a_restart_with_persistence(tmp_path: Path) -> None:
    cfg = BrokerConfig(federation=FEDERATION, persistence=True)
    digest = "aa" * 16
    with start_broker(cfg, tmp_path, kind="mosquitto") as broker:
        coord = connect_probe(Credentials.load(tmp_path / "credentials" / "coordinator.toml"))
        coord.publish(T.model_chunk(digest, 0), b"weights", retain=True)
        coord.close()
        port = broker.port
    assert (tmp_path / "data" / "mosquitto.db").exists()
    with start_broker(cfg, tmp_path, kind="mosquitto") as broker:
        assert broker.port == port  # the stored port is reused
        dev = add_device(tmp_path, "dev-a")
        broker.reload()
        wait_connectable(dev)
        probe = connect_probe(dev)
        probe.subscribe(T.model_filter(digest))
        assert probe.wait_for(lambda ms: ms == [(T.model_chunk(digest, 0), b"weights", True)])
        probe.close()


def test_stop_ends_exactly_that_pid_and_clears_the_record(tmp_path: Path) -> None:
    broker = start_broker(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path, kind="mosquitto")
    pid = broker.pid
    rec = json.loads((tmp_path / "run.json").read_text())
    assert rec["pid"] == pid and rec["port"] == broker.port and rec["kind"] == "mosquitto"
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-c", str(tmp_path / "mosquitto.conf").encode()]
    with pytest.raises(BrokerError, match="already runs"):
        start_broker(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path, kind="mosquitto")
    broker.stop()
    assert not Path(f"/proc/{pid}").exists()
    assert not (tmp_path / "run.json").exists() and recorded_process(tmp_path) is None


def test_a_stale_record_never_signals_a_foreign_process(tmp_path: Path) -> None:
    write_broker_files(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 5  # /proc shows the new command line only once exec has finished
        while Path(f"/proc/{sleeper.pid}/cmdline").read_bytes() != b"sleep\x0030\x00" and time.monotonic() < deadline:
            time.sleep(0.01)
        ticks = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        record = {"pid": sleeper.pid, "kind": "mosquitto", "argv": ["sleep", "30"], "start_ticks": ticks,
                  "host": "127.0.0.1", "port": 1, "tls_port": 0, "started_at": 0.0}
        for stale in ({"argv": ["/usr/sbin/mosquitto", "-c", "x"]}, {"start_ticks": ticks + 1}):
            (tmp_path / "run.json").write_text(json.dumps({**record, **stale}))
            assert stop_recorded(tmp_path, timeout=1) is None  # command line or start time differ: not ours
            assert sleeper.poll() is None, f"a foreign process was signalled ({stale})"
            assert not (tmp_path / "run.json").exists()
        # positive control: an exact match (same PID, command line and start time) is stopped
        (tmp_path / "run.json").write_text(json.dumps(record))
        assert stop_recorded(tmp_path, timeout=2) is not None
        assert sleeper.wait(2) == -15
    finally:
        sleeper.kill()
        sleeper.wait()


def test_start_errors_are_clear(tmp_path: Path) -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(BrokerError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_broker(BrokerConfig(federation=FEDERATION, port=port, persistence=False), tmp_path / "a",
                         kind="mosquitto")
    files = write_broker_files(BrokerConfig(federation=FEDERATION, persistence=False), tmp_path / "b")
    files.mosquitto_conf.write_text(files.mosquitto_conf.read_text() + "no_such_option 1\n")
    with pytest.raises(BrokerError, match="no_such_option") as err:
        BrokerProcess(files.state_dir).start(timeout=10)
    assert "exited with code" in str(err.value)
    assert recorded_process(files.state_dir) is None
