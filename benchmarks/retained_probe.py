"""Does a broker hand retained messages to wildcard subscriptions, as FLAYER Edge needs?

A publisher sends the round plan and three model chunks retained (QoS 1) the way the coordinator does
(``fl/<fed>/round``, ``fl/<fed>/model/<digest>/<i>``); then a fresh subscriber, connecting afterwards like
a device that comes online mid-round, subscribes once with the device's wildcard filter
(``fl/<fed>/model/<digest>/+``) and once with the exact topics, and the retained messages each got are
counted. Any MQTT 3.1.1 broker (docs/results/topologies.md, "Clustered broker")::

    python benchmarks/retained_probe.py --port 21883 --publisher coordinator:PW --subscriber dev-1:PW
    python benchmarks/retained_probe.py --credentials STATE/credentials/coordinator.toml \\
        --subscriber-credentials STATE/credentials/dev-1.toml
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transport.credentials import Credentials

DIGEST = "cd" * 32


def _user(text: str) -> tuple[str, str]:
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise argparse.ArgumentTypeError(f"expected USER:PASSWORD, got {text!r}")
    return user, password


def _client(host: str, port: int, user: str, password: str, clean: bool = True):  # type: ignore[no-untyped-def]
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=user, clean_session=clean, protocol=mqtt.MQTTv311)
    c.username_pw_set(user, password)
    connected = threading.Event()
    c.on_connect = lambda cl, ud, fl, rc, pr: connected.set() if not rc.is_failure else print(f"refused: {rc}")
    c.connect(host, port, keepalive=30)
    c.loop_start()
    if not connected.wait(10):
        raise SystemExit(f"{user} could not connect to {host}:{port}")
    return c


def probe(host: str, port: int, pub: tuple[str, str], sub: tuple[str, str], fed: str, sub_host: str | None = None,
          sub_port: int | None = None, wait_s: float = 2.0) -> dict[str, object]:
    prefix = f"fl/{fed}"
    topics = [f"{prefix}/round"] + [f"{prefix}/model/{DIGEST}/{i}" for i in range(3)]
    p = _client(host, port, *pub)
    infos = [p.publish(t, f"retained {t}".encode(), qos=1, retain=True) for t in topics]
    for info in infos:
        info.wait_for_publish(10)
    p.disconnect()
    p.loop_stop()
    time.sleep(0.5)
    out: dict[str, object] = {"published_retained": len(topics)}
    for label, filters in (("wildcard", [f"{prefix}/round", f"{prefix}/model/{DIGEST}/+"]), ("exact", topics)):
        got: list[str] = []
        s = _client(sub_host or host, sub_port or port, *sub)
        s.on_message = lambda cl, ud, msg, got=got: got.append(msg.topic) if msg.retain else None
        for f in filters:  # one SUBSCRIBE per filter
            s.subscribe(f, qos=1)
        time.sleep(wait_s)
        s.disconnect()
        s.loop_stop()
        out[f"{label}_filters"] = filters
        out[f"{label}_retained_received"] = sorted(set(got))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--publisher", type=_user, help="USER:PASSWORD of the publisher (the coordinator)")
    ap.add_argument("--subscriber", type=_user, help="USER:PASSWORD of the subscriber (a device)")
    ap.add_argument("--credentials", type=Path, help="the publisher's credentials file instead")
    ap.add_argument("--subscriber-credentials", type=Path, help="the subscriber's credentials file instead")
    ap.add_argument("--federation", default="probe")
    args = ap.parse_args(argv)
    host, port, sub_host, sub_port = args.host, args.port, None, None
    pub, sub, fed = args.publisher, args.subscriber, args.federation
    if args.credentials:
        c = Credentials.load(args.credentials)
        host, port, pub, fed = c.host, c.port, (c.username, c.password), c.federation
    if args.subscriber_credentials:
        c = Credentials.load(args.subscriber_credentials)
        sub_host, sub_port, sub = c.host, c.port, (c.username, c.password)
    if pub is None or sub is None:
        ap.error("give --publisher and --subscriber (or credentials files)")
    print(json.dumps(probe(host, port, pub, sub, fed, sub_host, sub_port), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
