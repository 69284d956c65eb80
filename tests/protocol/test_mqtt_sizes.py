"""The chunk-size arithmetic against a real broker: mosquitto with a small max_packet_size, MQTT 3.1.1.

Chunks sized by max_body_per_chunk go through and reassemble; a larger packet gets the publisher
disconnected (paho does not check). Mosquitto 2.0 compares ``remaining length + 1`` with the limit,
ignoring the 1-4 bytes of the remaining-length field, so the spec-exact size the helpers compute is
at most 3 bytes below what mosquitto would still take.
"""

from __future__ import annotations

import queue
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from protocol import (
    Kind,
    Reassembler,
    Topics,
    check_topic,
    chunk_blob,
    decode_envelope,
    header_size,
    max_body_per_chunk,
)

mqtt = pytest.importorskip("paho.mqtt.client")
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
PACKET_LIMIT = 4096

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not Path(MOSQUITTO).exists(), reason="mosquitto is not installed"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[int]:
    port = _free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        f"max_packet_size {PACKET_LIMIT}\n"
    )
    proc = subprocess.Popen(
        [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("mosquitto did not start")
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(port: int, name: str, events: queue.Queue) -> object:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv311)
    c.on_connect = lambda cl, ud, flags, rc, props: events.put(("connect", rc))
    c.on_disconnect = lambda cl, ud, flags, rc, props: events.put(("disconnect", rc))
    c.on_message = lambda cl, ud, msg: events.put(("message", (msg.topic, bytes(msg.payload))))
    c.reconnect_delay_set(60, 120)  # do not resend the oversized message during the test
    c.connect("127.0.0.1", port)
    c.loop_start()
    assert _wait(events, "connect")[1] == 0
    return c


def _wait(events: queue.Queue, kind: str, timeout: float = 10.0) -> tuple:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {kind} event")
        event = events.get(timeout=left)
        if event[0] == kind:
            return event


def test_chunks_sized_for_the_packet_limit_pass_and_larger_ones_do_not(broker: int) -> None:
    topics = Topics("fed")
    blob = np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    longest = topics.update_chunk("dev-1", 4, 99)
    body = max_body_per_chunk(PACKET_LIMIT, len(longest), "fed", "dev-1")
    payloads = chunk_blob(blob, Kind.UPDATE_CHUNK, "fed", "dev-1", 4, body + header_size("fed", "dev-1"))
    sub_events: queue.Queue = queue.Queue()
    pub_events: queue.Queue = queue.Queue()
    sub = _client(broker, "coordinator", sub_events)
    pub = _client(broker, "dev-1", pub_events)
    try:
        sub.subscribe(topics.all_updates(), qos=1)  # type: ignore[attr-defined]
        time.sleep(0.2)
        # the index in the topic is padded to the longest topic's length, so every packet is the largest
        for i, p in enumerate(payloads):
            pub.publish(topics.update_chunk("dev-1", 4, 90 + i), p, qos=1).wait_for_publish(5)  # type: ignore[attr-defined]
        r = Reassembler()
        for _ in payloads:
            topic, payload = _wait(sub_events, "message")[1]
            env = decode_envelope(payload)
            assert topic == topics.update_chunk("dev-1", 4, 90 + env.index)
            check_topic(env, topics.parse(topics.update_chunk("dev-1", 4, env.index)))
            r.add(env)
        assert r.blob() == blob
        assert len(payloads[0]) == body + header_size("fed", "dev-1")

        # the smallest payload mosquitto refuses: remaining length (2 + topic + 2 + payload) + 1 > limit
        refused = PACKET_LIMIT - 4 - len(longest)
        assert 0 < refused - len(payloads[0]) <= 4
        pub.publish(longest, b"x" * (refused - 1), qos=1).wait_for_publish(5)  # type: ignore[attr-defined]
        assert len(_wait(sub_events, "message")[1][1]) == refused - 1
        pub.publish(longest, b"x" * refused, qos=1)  # type: ignore[attr-defined]
        _wait(pub_events, "disconnect")
        with pytest.raises(queue.Empty):
            while True:
                event = sub_events.get(timeout=1.0)
                assert event[0] != "message", "the oversized chunk was delivered"
    finally:
        for c in (pub, sub):
            c.loop_stop()  # type: ignore[attr-defined]
            c.disconnect()  # type: ignore[attr-defined]
