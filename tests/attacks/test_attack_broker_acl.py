"""Who may read and write what on the broker (docs/explanation/guarantees.md, "Broker ACLs";
docs/explanation/security.md, "Parties and trust").

Three adversaries against a real Mosquitto loaded with the generated ACL, each with only what it holds:

- a stranger: no credentials, or a device's name with a guessed password, or another client id;
- an enrolled device (``dev-a``): its own credentials. It subscribes to everything of the federation and
  publishes what would hurt others: a plan, a model chunk, an ack, an update and a status under
  ``dev-b``'s id, a secure-aggregation request;
- an observer: its own credentials (reads plans, statuses and metrics). It subscribes to everything and
  publishes on every topic.

The guarantee, stated as the security model states it (not read back from the ACL file): no stranger gets
a CONNACK of 0; ``dev-a`` never receives ``dev-b``'s update, ack or secure-aggregation request, nor anything
of another federation; the observer receives the plan and statuses but no model chunk, update or ack;
nothing ``dev-a`` or the observer publishes on a topic they may not write reaches the coordinator, which
is subscribed to every topic of the federation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mqtt_broker import add_observer, load_credentials
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
DIGEST = "ab" * 32


def test_strangers_devices_and_observers_read_and_write_only_what_they_may(tmp_path: Path,
                                                                           attack_fed: Any) -> None:
    rb = attack_fed(DEVICES, adversary="dev-a", view="device", federation=FEDERATION)
    probes = []
    try:
        add_observer(rb.state_dir)
        rb.broker.reload()
        observer_creds = load_credentials(rb.state_dir, "observer")
        dev_a = mqtt_connect_settings(rb.devices["dev-a"])
        time.sleep(0.3)  # the reload is applied asynchronously

        # strangers
        assert try_connect(dev_a, no_credentials=True)[0] not in (0,)
        assert try_connect(dev_a, password="guessed-password")[0] not in (0,)
        assert try_connect(dev_a, username="nobody", password="x")[0] not in (0,)

        coord = connect_probe(rb.coordinator)
        a = connect_probe(rb.devices["dev-a"])
        b = connect_probe(rb.devices["dev-b"])
        obs = connect_probe(observer_creds)
        probes += [coord, a, b, obs]
        coord.subscribe("fl/#")
        a.subscribe("fl/#", "#")
        obs.subscribe("fl/#", "#")

        # what the legitimate parties publish
        coord.publish(T.round(), b"plan")
        coord.publish(T.model_chunk(DIGEST, 0), b"model")
        coord.publish(T.ack("dev-b"), b"ack for b")
        coord.publish(T.secreq("dev-b"), b"secreq for b")
        b.publish(T.update_chunk("dev-b", 1, 0), b"update of b")
        b.publish(T.status("dev-b"), b"status of b")
        # what the adversaries try to write
        forged = {
            T.round(): b"forged plan", T.model_chunk(DIGEST, 1): b"forged model", T.ack("dev-b"): b"forged ack",
            T.update_chunk("dev-b", 1, 1): b"forged update", T.status("dev-b"): b"forged status",
            T.secreq("dev-b"): b"forged secreq",
        }
        for topic, payload in forged.items():
            a.publish(topic, payload)  # acknowledged and dropped, as Mosquitto does
            obs.publish(topic, b"observer " + payload)
        obs.publish(T.update_chunk("observer", 1, 0), b"observer update")
        obs.publish(T.status("observer"), b"observer status")

        # positive controls: the legitimate messages arrived where they should
        assert obs.wait_for(lambda ms: {(T.round(), b"plan"), (T.status("dev-b"), b"status of b")}
                            <= {m[:2] for m in ms}, 5)
        assert coord.wait_for(lambda ms: (T.update_chunk("dev-b", 1, 0), b"update of b") in {m[:2] for m in ms}, 5)
        assert a.wait_for(lambda ms: (T.round(), b"plan") in {m[:2] for m in ms}, 5)
        time.sleep(NEGATIVE_WINDOW_S)

        read_by_a = {m[:2] for m in a.messages}
        for secret in [(T.ack("dev-b"), b"ack for b"), (T.secreq("dev-b"), b"secreq for b"),
                       (T.update_chunk("dev-b", 1, 0), b"update of b")]:
            assert secret not in read_by_a, f"dev-a read {secret}"
        read_by_obs = {m[:2] for m in obs.messages}
        for secret in [(T.model_chunk(DIGEST, 0), b"model"), (T.ack("dev-b"), b"ack for b"),
                       (T.update_chunk("dev-b", 1, 0), b"update of b"), (T.secreq("dev-b"), b"secreq for b")]:
            assert secret not in read_by_obs, f"the observer read {secret}"
        got = [m[1] for m in coord.messages]
        leaked = [p for p in got if p.startswith((b"forged", b"observer"))]
        assert leaked == [], f"writes the ACL forbids reached the coordinator: {leaked}"
    finally:
        for p in probes:
            p.close()
