"""A forged retained plan through the clustered broker's wills (docs/explanation/guarantees.md, "Broker ACLs").

The adversary is an enrolled device of the federation: it holds its own broker credentials and nothing else.
It connects to the cluster node its credentials name with a retained will on the federation's plan topic
``fl/<fed>/round`` (which the ACL does not let it publish) and waits for that node to die, the case the
cluster's failover exists for. When a node dies, a surviving node publishes the wills of the clients that
were on it. The guarantee holds when the coordinator, subscribed to the plan topic on the surviving node,
never receives the forged plan and nothing is retained on the plan topic afterwards: the will is refused at
CONNECT (a client may set a will only on a topic it could publish itself, its own status topic), and a will
delivered for a dead node's client is checked again against the rules of the node that delivers it.

Slow: a node counts as dead once its heartbeats (every 5 s) have stopped for 15 s, and the surviving node
looks for the dead node's wills every 20 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from mqtt_broker import BrokerConfig, add_device, load_credentials
from mqtt_broker.cluster import cluster_missing, start_cluster
from protocol.topics import Topics
from tests.mqtt_broker.broker_testlib import connect_probe
from transport.credentials import mqtt_connect_settings

MISSING = cluster_missing()
FORGED = b"FORGED-BY-dev-1"


def _connect_with_will(creds, topic: str) -> tuple[int | None, mqtt.Client]:
    """Connect as the device with a retained QoS 1 will on ``topic``; returns the CONNACK code (None: no
    CONNACK) and the client (its network loop running when accepted)."""
    settings = mqtt_connect_settings(creds)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=settings.client_id, protocol=mqtt.MQTTv311,
                         clean_session=False)
    client.username_pw_set(settings.username, settings.password)
    client.will_set(topic, FORGED, qos=1, retain=True)
    got: dict[str, int] = {}

    def on_connect(c, userdata, flags, reason_code, properties):
        got.setdefault("rc", int(reason_code.value))

    client.on_connect = on_connect
    client.connect(settings.host, settings.port, keepalive=30)
    deadline = time.monotonic() + 5
    while "rc" not in got and time.monotonic() < deadline:
        if client.loop(timeout=0.05) not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_AGAIN):
            break
    if got.get("rc") == 0:
        client.loop_start()
    return got.get("rc"), client


@pytest.mark.slow
@pytest.mark.skipif(MISSING is not None, reason=f"no broker cluster here: {MISSING}")
def test_a_device_will_on_the_plan_topic_never_reaches_the_coordinator(tmp_path: Path) -> None:
    fed = "willfed"
    t = Topics(fed)
    state = tmp_path / "broker"
    cluster = start_cluster(BrokerConfig(federation=fed, persistence=False), state, 2)
    clients: list[mqtt.Client] = []
    probes = []
    try:
        for d in ("dev-1", "dev-2"):
            add_device(state, d)
        cluster.reload()
        coord_creds = load_credentials(state, "coordinator")
        dev_creds = load_credentials(state, "dev-1")
        assert (coord_creds.port, dev_creds.port) == cluster.ports  # coordinator on node 0, the device on node 1
        coord = connect_probe(coord_creds)
        probes.append(coord)
        coord.subscribe(t.round(), t.status("dev-2"))
        coord.publish(t.round(), b"the coordinator's plan", retain=True)
        assert coord.wait_for(lambda ms: (t.round(), b"the coordinator's plan", False) in ms)

        rc, dev = _connect_with_will(dev_creds, t.round())
        clients.append(dev)
        # an honest device on node 1 too, with the will every device sets: the positive control that the
        # surviving node did deliver the dead node's wills
        honest = load_credentials(state, "dev-2")
        assert honest.port == cluster.ports[1]
        hrc, hdev = _connect_with_will(honest, t.status("dev-2"))
        clients.append(hdev)
        assert hrc == 0
        # the attacker is on node 1 (connected or refused there); the attack needs node 1 to die
        cluster.kill_node(1)
        dev.loop_stop()
        hdev.loop_stop()
        # wait past the dead node's heartbeat window and one of the survivor's sweeps for wills
        assert coord.wait_for(lambda ms: any(m[:2] == (t.status("dev-2"), FORGED) for m in ms), timeout=60.0), \
            "the surviving node never delivered the dead node's wills"
        time.sleep(1.0)  # the wills of one sweep go out together
        forged = [m for m in coord.messages if m[0] == t.round() and m[1] == FORGED]
        assert not forged, f"the coordinator received the forged plan (the attacker's CONNACK was {rc})"
        late = connect_probe(coord_creds, client_id=None)
        probes.append(late)
        late.subscribe(t.round())
        assert late.wait_for(lambda ms: bool(ms), timeout=3.0), "nothing retained on the plan topic at all"
        assert [(p, r) for _, p, r in late.messages] == [(b"the coordinator's plan", True)]
    finally:
        for c in clients:
            c.loop_stop()
        for p in probes:
            p.close()
        cluster.stop()


@pytest.mark.skipif(MISSING is not None, reason=f"no broker cluster here: {MISSING}")
def test_a_will_off_the_own_status_topic_is_refused_at_connect(tmp_path: Path) -> None:
    fed = "willcon"
    t = Topics(fed)
    state = tmp_path / "broker"
    cluster = start_cluster(BrokerConfig(federation=fed, persistence=False), state, 2)
    clients: list[mqtt.Client] = []
    try:
        for d in ("dev-1", "dev-2"):
            add_device(state, d)
        cluster.reload()
        dev = load_credentials(state, "dev-1")
        for topic in (t.round(), t.ack("dev-1"), t.status("dev-2"), t.update_chunk("dev-1", 1, 0)):
            rc, c = _connect_with_will(dev, topic)
            clients.append(c)
            assert rc in (5, 135), f"a will on {topic} was accepted at CONNECT (CONNACK {rc})"  # not authorised
        rc, c = _connect_with_will(dev, t.status("dev-1"))  # the will every device sets
        clients.append(c)
        assert rc == 0
    finally:
        for c in clients:
            c.loop_stop()
            c.disconnect()
        cluster.stop()
