"""Payloads an authorised device can publish, honest or not, and a device the test drives by hand.

The honest updates are seeded dense deltas over every tensor of the model, so the model a run
should reach can be computed offline by folding them; the bad ones are built from honest ones
(field patches, bit flips, truncations, NaN bit patterns...) so they reach as deep into the
coordinator as each fault allows."""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from fedtestlib import Recorder

from flayer.update import TensorDelta, Update
from mqtt_broker import Credentials
from protocol import (
    Ack,
    Kind,
    Plan,
    SigningKey,
    Status,
    Topics,
    UpdateHeader,
    blob_digest,
    chunk_blob,
    decode_message,
    encode_message,
    encode_update,
)
from protocol.envelope import _context, signed_data

# the signing keys of the devices the tests drive (their own, from their credentials): a hostile device signs
# whatever it sends, junk included, so its junk reaches the checks behind the signature
KEYS: dict[str, SigningKey] = {}

# envelope header fields (protocol/envelope.py): offset and struct format
FIELD = {
    "version": (4, "<B"),
    "kind": (5, "<B"),
    "flags": (7, "<B"),
    "round": (8, "<I"),
    "index": (12, "<I"),
    "count": (16, "<I"),
    "total": (20, "<Q"),
    "body_len": (28, "<I"),
    "crc": (32, "<I"),
}
DIGEST_AT = 36
SENTINEL = np.float32(1234.5677)


def honest_update(
    shapes: Mapping[str, tuple[int, ...]],
    header: UpdateHeader,
    seed: int,
    scale: float = 0.01,
    samples: int = 50,
) -> bytes:
    """A seeded dense update over every tensor (norm ~ scale * sqrt(numel))."""
    rng = np.random.default_rng(seed)
    deltas = {
        k: TensorDelta(tuple(s), (rng.standard_normal(int(np.prod(s))) * scale).astype(np.float32))
        for k, s in sorted(shapes.items())
    }
    return encode_update(Update(deltas, samples, {"test_correct": 1.0, "test_total": 4.0}), header)


def sparse_update(
    header: UpdateHeader, name: str, shape: tuple[int, ...], values: list[float], samples: int = 50
) -> bytes:
    """An update of one tensor at positions 0..len(values)-1."""
    v = np.asarray(values, dtype=np.float32)
    return encode_update(Update({name: TensorDelta(shape, v, np.arange(v.size))}, samples), header)


def with_bad_value(header: UpdateHeader, name: str, shape: tuple[int, ...], bits: bytes) -> bytes:
    """A valid update blob whose one value is then overwritten with the fp32 ``bits`` (NaN, Inf...):
    the encoder refuses such values, a modified device need not."""
    blob = sparse_update(header, name, shape, [0.01, float(SENTINEL), 0.02])
    at = blob.find(struct.pack("<f", SENTINEL))
    assert at > 0 and blob.count(struct.pack("<f", SENTINEL)) == 1
    return blob[:at] + bits + blob[at + 4 :]


def chunks(
    blob: bytes,
    sender: str,
    round_: int,
    size: int = 100_000,
    federation: str = "ftest",
    digest: str | None = None,
) -> list[bytes]:
    return chunk_blob(blob, Kind.UPDATE_CHUNK, federation, sender, round_, size, digest, key=KEYS.get(sender))


def sign(payload: bytes) -> bytes:
    """``payload`` signed again by its sender (in :data:`KEYS`); unchanged when that cannot be done (no such
    key, a header the signature cannot describe: the decoder refuses those before the signature)."""
    try:
        flen, slen = payload[68], payload[69]
        start = 70 + flen + slen
        fed, sender = payload[70 : 70 + flen].decode("ascii"), payload[70 + flen : start].decode("ascii")
        key = KEYS.get(sender)
        if key is None or len(payload) < start + 64:
            return payload
        ctx = _context(Kind(payload[5]), fed, sender, struct.unpack_from("<I", payload, 8)[0])
        body, count = payload[start + 64 :], struct.unpack_from("<I", payload, 16)[0]
        return payload[:start] + key.sign(ctx, signed_data(payload[:start], body, count)) + body
    except (ValueError, IndexError, UnicodeDecodeError):
        return payload


def patch(payload: bytes, field: str, value: int) -> bytes:
    """``payload`` with one envelope header field set to ``value`` (nothing else changed but the signature,
    made again by the sender)."""
    at, fmt = FIELD[field]
    return sign(payload[:at] + struct.pack(fmt, value) + payload[at + struct.calcsize(fmt) :])


def read_field(payload: bytes, field: str) -> int:
    at, fmt = FIELD[field]
    return int(struct.unpack_from(fmt, payload, at)[0])


class Device:
    """A device driven by the test with its real credentials: presence, plans, raw publishes, acks."""

    def __init__(self, creds: Credentials, topics: Topics, online: bool = True) -> None:
        self.creds, self.t, self.id = creds, topics, creds.username
        self.key = KEYS[self.id] = creds.signer()
        self.rec = Recorder(creds, [topics.round(), topics.ack(creds.username)])
        if online:
            self.status("online")

    def status(self, state: str) -> None:
        payload = encode_message(Status(0, state, time.time()), self.t.federation, self.id, key=self.key)
        self.publish([(self.t.status(self.id), payload)], retain=True)

    def publish(self, items: list[tuple[str, bytes]], retain: bool = False, timeout: float = 30.0) -> None:
        assert self.rec.link.publish_all([(t, p, retain) for t, p in items], timeout), "PUBACKs missing"

    def send_chunks(self, payloads: list[bytes], round_: int, indices: list[int] | None = None) -> None:
        """Publish payloads on this device's update topics (chunk i on topic .../i by default)."""
        idx = indices if indices is not None else list(range(len(payloads)))
        topics = [self.t.update_chunk(self.id, round_, i) for i in idx]
        self.publish(list(zip(topics, payloads, strict=True)))

    def send(self, blob: bytes, round_: int, size: int = 100_000) -> str:
        self.send_chunks(chunks(blob, self.id, round_, size, self.t.federation), round_)
        return blob_digest(blob)

    def plan(self, round_: int, timeout: float = 60.0) -> Plan:
        def is_plan(m: Any) -> bool:
            return (
                m.topic == self.t.round() and bool(m.payload) and decode_message(m.payload)[1].round == round_
            )

        msg = self.rec.wait_message(is_plan, timeout)
        assert msg is not None, f"{self.id}: no plan for round {round_}"
        plan = decode_message(msg.payload)[1]
        assert isinstance(plan, Plan)
        return plan

    def ack(self, digest: str, timeout: float = 30.0) -> Ack:
        def is_ack(m: Any) -> bool:
            if m.topic != self.t.ack(self.id):
                return False
            return getattr(decode_message(m.payload)[1], "update_digest", "") == digest

        msg = self.rec.wait_message(is_ack, timeout)
        assert msg is not None, f"{self.id}: no ack for {digest[:12]}"
        ack = decode_message(msg.payload)[1]
        assert isinstance(ack, Ack)
        self.rec.messages.remove(msg)  # a later ack for the same blob (a replay) is awaited afresh
        return ack

    def close(self) -> None:
        try:
            self.publish([(self.t.status(self.id), b"")], retain=True, timeout=5)
        finally:
            self.rec.close()
