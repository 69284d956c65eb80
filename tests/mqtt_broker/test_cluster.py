"""The clustered broker (mqtt_broker.cluster): the Aedes node's password and ACL checks against the Python
reference (which mirrors Mosquitto), the failover addresses of credentials files, and one live smoke test
of a two-node cluster over a real Redis (retained model chunks through a wildcard on the other node, a
denied publish, a revoked device, a node killed and the device on another node with its session)."""

from __future__ import annotations

import json
import queue
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mqtt_broker import BrokerConfig, add_device, add_observer, load_credentials
from mqtt_broker.acl import parse_acl, render_acl
from mqtt_broker.cluster import NODE_PROGRAM, cluster_missing, node_of, start_cluster
from mqtt_broker.fsutil import find_executable
from mqtt_broker.kit import revoke_device
from mqtt_broker.passwords import _pbkdf2_hash, hash_password
from protocol.topics import Topics
from transport.credentials import Credentials, CredentialsError, mqtt_connect_settings, parse_address
from transport.link import Connected, MqttLink, Received, probe

MISSING = cluster_missing()
needs_node = pytest.mark.skipif(find_executable("node") is None or MISSING is not None and "Aedes" in MISSING,
                                reason=f"the Aedes node cannot run: {MISSING}")
needs_cluster = pytest.mark.skipif(MISSING is not None, reason=f"no broker cluster here: {MISSING}")
DIGEST = "ab" * 32


def _node_check(questions: list[dict]) -> list[object]:
    proc = subprocess.run(["node", str(NODE_PROGRAM), "--check"], input="\n".join(json.dumps(q) for q in questions),
                          capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines()][1:]


@needs_node
def test_node_enforces_the_same_acl_and_passwords_as_mosquitto(tmp_path: Path) -> None:
    acl = parse_acl(render_acl("f1", "coordinator", ["observer", "watch-2"]))
    t, other = Topics("f1"), Topics("f2")
    topics = [t.round(), t.model_chunk(DIGEST, 0), t.update_chunk("dev-1", 3, 0), t.update_chunk("dev-2", 3, 0),
              t.ack("dev-1"), t.ack("dev-2"), t.status("dev-1"), t.status("observer"), t.metrics("dev-1"),
              t.secagg("dev-1"), t.secreq("dev-1"), t.secreq("dev-2"), other.round(), "$SYS/broker/x", "fl/f1",
              "fl/f1/update/dev-1", "fl/f1/ack/dev-1/extra"]
    who = [("coordinator", "coordinator"), ("observer", "observer"), ("watch-2", "watch-2"), ("dev-1", "dev-1"),
           ("dev-2", "dev-2"), ("dev-1", "dev+1"), ("nobody", "nobody")]
    cases = [{"user": u, "client": c, "topic": tp, "access": a} for u, c in who for tp in topics
             for a in ("read", "write")]
    pw = "s3cret-pw"
    hashes = [_pbkdf2_hash(pw, b"0123456789ab"), hash_password("u", pw, tmp_path), "$6$bad", "plain"]
    pw_cases = [{"password": p, "hash": h} for h in hashes for p in (pw, pw + "x")]
    filters = ["fl/#", "fl/+/round", "fl/#/x", "fl/a+", "", "a/b#"]
    answers = _node_check([{"passwd": {}, "acl": {"users": {u: [list(r) for r in rs] for u, rs in acl.users.items()},
                                                  "patterns": [list(r) for r in acl.patterns]}},
                           *cases, *pw_cases, *({"filter": f} for f in filters)])
    want = [acl.allows(q["user"], q["client"], q["topic"], q["access"]) for q in cases]
    assert answers[:len(cases)] == want
    assert sum(want) > 20 and not all(want)  # both verdicts occur
    assert answers[len(cases):len(cases) + len(pw_cases)] == [True, False, True, False, False, False, False, False]
    assert answers[len(cases) + len(pw_cases):] == [acl.may_subscribe(f) for f in filters]


def test_credentials_failover_round_trip_and_validation(tmp_path: Path) -> None:
    creds = Credentials("f1", "device", "dev-1", "pw", "127.0.0.1", 1884, 1 << 20,
                        failover=(("127.0.0.1", 1885), ("::1", 1886)))
    path = tmp_path / "dev-1.toml"
    path.write_text(creds.to_toml())
    back = Credentials.load(path)
    assert back == creds and back.failover == (("127.0.0.1", 1885), ("::1", 1886))
    assert mqtt_connect_settings(back).failover == creds.failover
    assert parse_address("[::1]:1886") == ("::1", 1886)
    for bad in ("127.0.0.1", "h:0", "h:65536", ":1883", "h o:1"):
        with pytest.raises(CredentialsError, match="failover address"):
            parse_address(bad)
    path.write_text(creds.to_toml().replace('"127.0.0.1:1885"', '"127.0.0.1:x"'))
    with pytest.raises(CredentialsError, match="failover address"):
        Credentials.load(path)
    path.write_text(creds.to_toml().replace("failover = [", "failover = [1, "))
    with pytest.raises(CredentialsError, match="list of"):
        Credentials.load(path)
    with pytest.raises(CredentialsError, match="at most"):
        replace(creds, failover=tuple(("h", 1000 + i) for i in range(17)))
    assert [node_of(f"dev-{i}", "device", 3) for i in range(6)] != [0] * 6
    assert {node_of(f"dev-{i}", "device", 3) for i in range(20)} == {1, 2}
    assert node_of("coordinator", "coordinator", 3) == 0 and node_of("dev-1", "device", 1) == 0


class _Link:
    def __init__(self, creds: Credentials, clean: bool = True) -> None:
        self.events: queue.Queue = queue.Queue()
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=clean,
                             reconnect_delay=(1, 1))
        self.link.start()
        assert self.wait(lambda e: isinstance(e, Connected) and e.ok), f"{creds.username} did not connect"

    def wait(self, pred, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if pred(ev):
                return ev
        return None

    def messages(self, seconds: float) -> list[Received]:
        out: list[Received] = []
        self.wait(lambda e: isinstance(e, Received) and out.append(e) and False, seconds)  # type: ignore[func-returns-value]
        return out


@needs_cluster
def test_cluster_smoke_retained_wildcards_acl_revoke_and_failover(tmp_path: Path) -> None:
    state = tmp_path / "broker"
    t = Topics("smoke")
    cluster = start_cluster(BrokerConfig(federation="smoke", persistence=False), state, 2)
    links: list[_Link] = []
    try:
        for d in ("dev-1", "dev-2"):
            add_device(state, d)
        add_observer(state, "watch-2")
        cluster.reload()
        coord = load_credentials(state, "coordinator")
        dev = load_credentials(state, "dev-1")
        assert (coord.port, dev.port) == cluster.ports and dev.failover == (("127.0.0.1", cluster.ports[0]),)
        c = _Link(coord)
        links.append(c)
        chunks = [(t.model_chunk(DIGEST, i), bytes([i]) * 1000, True) for i in range(3)] + [(t.round(), b"plan", True)]
        assert c.link.publish_all(chunks, 10)
        d1 = _Link(dev, clean=False)  # on node 1: the retained messages were published on node 0
        links.append(d1)
        d1.link.subscribe([t.model_filter(DIGEST), t.round(), t.ack("dev-1")])
        got = {m.topic: m for m in d1.messages(1.5)}
        assert set(got) == {x[0] for x in chunks} and all(m.retain for m in got.values())
        assert got[t.model_chunk(DIGEST, 2)].payload == bytes([2]) * 1000
        # a publish the ACL denies is acknowledged and dropped (as Mosquitto does); the device stays connected
        assert d1.link.publish_all([(t.model_chunk(DIGEST, 0), b"forged", True)], 5) and d1.link.connected.is_set()
        # an update on node 1 reaches the coordinator on node 0
        c.link.subscribe([t.all_updates()])
        time.sleep(0.3)
        assert d1.link.publish_all([(t.update_chunk("dev-1", 1, 0), b"u", False)], 5)
        assert c.wait(lambda e: isinstance(e, Received) and e.topic == t.update_chunk("dev-1", 1, 0))
        # a packet over max_packet_size closes the connection (Mosquitto too)
        dev2 = load_credentials(state, "dev-2")
        big = _Link(dev2)
        links.append(big)
        big.link.publish(t.update_chunk("dev-2", 1, 0), b"x" * (1 << 20))
        assert big.wait(lambda e: type(e).__name__ == "Disconnected", 5)
        big.link.stop()
        # node 1 dies: the device fails over to node 0, its session (subscription, queued ack) intact
        cluster.kill_node(1)
        assert d1.wait(lambda e: type(e).__name__ == "Disconnected", 5)
        c.link.publish_all([(t.ack("dev-1"), b"ack while failing over", False)], 5)
        ev = d1.wait(lambda e: isinstance(e, Connected), 10)
        assert ev is not None and ev.ok and ev.session_present
        assert d1.link.client.port == cluster.ports[0]
        assert d1.wait(lambda e: isinstance(e, Received) and e.payload == b"ack while failing over", 5)
        # a revoked device is refused after the reload
        revoke_device(state, "dev-2")
        cluster.reload()
        on_node0 = replace(dev2, port=cluster.ports[0], failover=())
        answer = probe(mqtt_connect_settings(on_node0))
        assert answer is not None and not answer.ok
        assert probe(mqtt_connect_settings(load_credentials(state, "watch-2"))).ok  # type: ignore[union-attr]
    finally:
        for link in links:
            link.link.stop(timeout=0.5)
        cluster.stop()
    assert not cluster.is_running()
