"""Helpers for the broker tests: a recording paho client and the ACL-matrix experiment."""

from __future__ import annotations

import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from mqtt_broker import BrokerConfig, ManagedBroker, add_device, mosquitto_available, start_broker
from mqtt_broker.acl import parse_acl
from mqtt_broker.state import BrokerFiles, load_credentials
from protocol.topics import Topics
from transport.credentials import ConnectSettings, Credentials, mqtt_connect_settings

NEGATIVE_WINDOW_S = 0.6  # how long "nothing arrives" is awaited once a positive control has arrived


@dataclass
class Probe:
    """A connected paho client that records every message it receives."""

    client: Any
    name: str
    messages: list[tuple[str, bytes, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def topics(self) -> list[str]:
        with self.lock:
            return [m[0] for m in self.messages]

    def subscribe(self, *filters: str, timeout: float = 3.0) -> list[int]:
        done = threading.Event()
        codes: list[int] = []

        def on_subscribe(client, userdata, mid, reason_codes, properties):  # type: ignore[no-untyped-def]
            codes.extend(int(rc.value) for rc in reason_codes)
            done.set()

        self.client.on_subscribe = on_subscribe
        self.client.subscribe([(f, 1) for f in filters])
        assert done.wait(timeout), f"{self.name}: no SUBACK for {filters}"
        return codes

    def publish(self, topic: str, payload: bytes, retain: bool = False, timeout: float = 3.0) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(timeout)
        assert info.is_published(), f"{self.name}: publish to {topic} not acknowledged"

    def wait_for(self, predicate, timeout: float = 3.0) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(list(self.messages)):
                    return True
            time.sleep(0.02)
        with self.lock:
            return bool(predicate(list(self.messages)))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def try_connect(settings: ConnectSettings, client_id: str | None = None, username: str | None = None,
                password: str | None = None, no_credentials: bool = False, timeout: float = 3.0,
                clean_session: bool = True) -> tuple[int | None, Any]:
    """Connect; returns (CONNACK reason code or None when no CONNACK came, the client).
    The caller closes the client (or uses :func:`connect_probe`)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or settings.client_id, protocol=mqtt.MQTTv311,
                         clean_session=clean_session)
    if not no_credentials:
        client.username_pw_set(username or settings.username, settings.password if password is None else password)
    if settings.ssl_context is not None:
        client.tls_set_context(settings.ssl_context)
    result: dict[str, int] = {}
    done = threading.Event()

    def on_connect(c, userdata, flags, reason_code, properties):  # type: ignore[no-untyped-def]
        result.setdefault("rc", int(reason_code.value))
        done.set()

    def on_disconnect(c, userdata, flags, reason_code, properties):  # type: ignore[no-untyped-def]
        done.set()

    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    try:
        client.connect(settings.host, settings.port, keepalive=30)
    except (OSError, ssl.SSLError):
        return None, client
    deadline = time.monotonic() + timeout
    while not done.is_set() and time.monotonic() < deadline:  # drive the handshake here: no thread to join
        if client.loop(timeout=0.05) not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_AGAIN):
            break
    if result.get("rc") == 0:
        client.loop_start()
    else:
        client.disconnect()
    return result.get("rc"), client


def connect_probe(creds: Credentials, use_tls: bool = False, client_id: str | None = None) -> Probe:
    settings = mqtt_connect_settings(creds, use_tls)
    rc, client = try_connect(settings, client_id=client_id)
    assert rc == 0, f"{creds.username} could not connect (CONNACK {rc})"
    probe = Probe(client, creds.username)

    def on_message(c, userdata, msg):  # type: ignore[no-untyped-def]
        with probe.lock:
            probe.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain)))

    client.on_message = on_message
    return probe


def matrix_topics(federation: str, ids: list[str]) -> list[str]:
    """One concrete topic per topic kind and per target id, plus topics of another federation."""
    t, other = Topics(federation), Topics(federation + "-other")
    topics = [t.round(), t.model_chunk("ab" * 16, 0)]
    for who in ids:
        topics += [t.update_chunk(who, 1, 0), t.ack(who), t.status(who), t.metrics(who), t.secagg(who), t.secreq(who)]
    return topics + [other.round(), other.update_chunk(ids[0], 1, 0), other.ack(ids[0])]


def run_acl_matrix(acl_file: Path, creds: dict[str, Credentials], federation: str) -> tuple[set, set]:
    """Every user subscribes to every topic and publishes to every topic; returns (expected, observed)
    sets of (subscriber, publisher, topic). Expected comes from the parsed ACL file."""
    acl = parse_acl(acl_file.read_text())
    topics = matrix_topics(federation, sorted(creds))
    expected = {(sub, pub, topic) for sub in creds for pub in creds for topic in topics
                if acl.allows(pub, pub, topic, "write") and acl.allows(sub, sub, topic, "read")}
    probes = {name: connect_probe(c) for name, c in creds.items()}
    try:
        for probe in probes.values():
            probe.subscribe(*topics)
        for name, probe in probes.items():
            for topic in topics:
                probe.publish(topic, f"{name}|{topic}".encode())

        def observed() -> set:
            out = set()
            for sub, probe in probes.items():
                for topic, payload, _ in list(probe.messages):
                    pub, _, ptopic = payload.decode().partition("|")
                    assert ptopic == topic
                    out.add((sub, pub, topic))
            return out

        deadline = time.monotonic() + 5.0
        while not expected <= observed() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(NEGATIVE_WINDOW_S)  # let anything that should NOT arrive show up
        return expected, observed()
    finally:
        for probe in probes.values():
            probe.close()


FEDERATION = "t1"
DEVICES = ("dev-a", "dev-b")

needs_mosquitto = pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")


@dataclass
class RunningBroker:
    broker: ManagedBroker
    files: BrokerFiles
    creds: dict[str, Credentials]

    @property
    def kind(self) -> str:
        return self.broker.kind


def start_test_broker(tmp: Path, kind: str, **cfg_kw: object) -> RunningBroker:
    """A broker with devices dev-a and dev-b (and the coordinator), reloaded and ready."""
    cfg = BrokerConfig(federation=FEDERATION, persistence=False, **cfg_kw)  # type: ignore[arg-type]
    broker = start_broker(cfg, tmp, kind=kind, timeout=20)
    creds = {d: add_device(tmp, d) for d in DEVICES}
    creds["coordinator"] = load_credentials(tmp, "coordinator")
    broker.reload()
    wait_connectable(creds[DEVICES[-1]])
    return RunningBroker(broker, BrokerFiles.at(tmp), creds)


def wait_connectable(creds: Credentials, use_tls: bool = False, timeout: float = 5.0) -> None:
    """Poll until ``creds`` are accepted (a reload is applied asynchronously by the broker)."""
    settings = mqtt_connect_settings(creds, use_tls)
    deadline = time.monotonic() + timeout
    while True:
        rc, client = try_connect(settings, timeout=1.0)
        if rc == 0:
            client.disconnect()
            client.loop_stop()
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{creds.username} still refused (CONNACK {rc}) {timeout} s after the reload")
        time.sleep(0.05)


def stop_test_broker(rb: RunningBroker) -> None:
    pid = rb.broker.pid
    rb.broker.stop()
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


def secrets_of(rb: RunningBroker) -> list[str]:
    return [c.password for c in rb.creds.values()]


def file_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777
