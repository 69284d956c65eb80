"""Envelope layout, MQTT size arithmetic, chunking and reassembly."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from _wirecraft import envelope

from protocol import (
    ChunkCollector,
    EncodeError,
    Envelope,
    Kind,
    Reassembler,
    Topics,
    WireError,
    WireLimits,
    check_topic,
    chunk_blob,
    decode_envelope,
    header_size,
    max_body_per_chunk,
    mqtt_payload_limit,
)


def _blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_envelope_matches_the_documented_layout() -> None:
    body = b"hello"
    env = Envelope(Kind.UPDATE_CHUNK, "fed", "c1", 9, 0, 1, 5, hashlib.sha256(body).hexdigest(), body)
    assert env.encode() == envelope(body, kind=2, round_=9)
    assert len(env.encode()) == header_size("fed", "c1") + 5 == 70 + 3 + 2 + 64 + 5
    assert decode_envelope(env.encode()) == env


def _publish_packet_size(topic: str, payload_len: int, qos: int = 1, props: int | None = None) -> int:
    """Size of an MQTT PUBLISH packet, computed independently from the MQTT spec (3.3); a packet
    over the protocol's largest remaining length (268,435,455) counts as infinitely large."""
    rl = 2 + len(topic.encode()) + (2 if qos else 0) + payload_len
    if props is not None:
        rl += props + (1 if props < 128 else 2)
    if rl > 268_435_455:
        return 1 << 62
    vl = 1 if rl < 128 else 2 if rl < 16384 else 3 if rl < 2097152 else 4
    return 1 + vl + rl


@pytest.mark.parametrize("limit", [200, 130, 131, 16_386, 16_387, 16_388, 1 << 20, 268_435_460, 10**9])
@pytest.mark.parametrize("props", [None, 0, 300])
def test_payload_limit_is_the_largest_that_fits(limit: int, props: int | None) -> None:
    topic = Topics("fed").update_chunk("client-7", 12, 99)
    if _publish_packet_size(topic, 1, 1, props) > limit:
        with pytest.raises(EncodeError):
            mqtt_payload_limit(limit, len(topic), 1, props)
        return
    best = mqtt_payload_limit(limit, len(topic), 1, props)
    assert _publish_packet_size(topic, best, 1, props) <= limit
    assert _publish_packet_size(topic, best + 1, 1, props) > limit


def test_chunks_fit_the_packet_limit_and_reassemble_in_any_order() -> None:
    topics = Topics("fed")
    blob = _blob(100_000)
    packet_limit = 4096
    longest_topic = topics.update_chunk("c1", 3, 10**6)
    body = max_body_per_chunk(packet_limit, len(longest_topic), "fed", "c1")
    payloads = chunk_blob(blob, Kind.UPDATE_CHUNK, "fed", "c1", 3, body + header_size("fed", "c1"))
    assert len(payloads) == -(-len(blob) // body)
    for i, p in enumerate(payloads):
        assert _publish_packet_size(topics.update_chunk("c1", 3, i), len(p)) <= packet_limit
    order = np.random.default_rng(0).permutation(len(payloads))
    r = Reassembler()
    for n, i in enumerate(order):
        env = decode_envelope(payloads[i])
        check_topic(env, topics.parse(topics.update_chunk("c1", 3, int(i))))
        assert r.add(env) == (n == len(payloads) - 1)
        assert r.add(env) == (n == len(payloads) - 1)  # an identical duplicate is ignored
        assert len(r.missing()) == len(payloads) - n - 1
    assert r.blob() == blob


def test_empty_and_single_chunk_blobs() -> None:
    for blob in (b"", b"x"):
        (payload,) = chunk_blob(blob, Kind.MODEL_CHUNK, "fed", "coord", 1, 1000)
        r = Reassembler()
        assert r.add(decode_envelope(payload))
        assert r.blob() == blob


def test_missing_chunks_are_reported() -> None:
    payloads = chunk_blob(_blob(1000), Kind.MODEL_CHUNK, "fed", "coord", 1, 200)
    r = Reassembler()
    assert r.missing() == []
    for i in (0, 3, 5):
        r.add(decode_envelope(payloads[i]))
    assert r.missing() == [i for i in range(len(payloads)) if i not in (0, 3, 5)]
    with pytest.raises(WireError, match="incomplete"):
        r.blob()


def _chunks(blob: bytes, size: int = 300, **kw: Any) -> list[Envelope]:
    args: dict[str, Any] = {"kind": Kind.UPDATE_CHUNK, "federation": "fed", "sender": "c1", "round_": 2, **kw}
    return [decode_envelope(p) for p in chunk_blob(blob, max_payload=size, **args)]


def test_reassembler_rejects_what_does_not_belong() -> None:
    blob = _blob(1000)
    envs = _chunks(blob)
    r = Reassembler()
    r.add(envs[0])
    # conflicting duplicate
    forged = Envelope(**{**envs[1].__dict__, "body": bytes(len(envs[1].body))})
    r.add(envs[1])
    with pytest.raises(WireError, match="different bytes"):
        r.add(forged)
    # inconsistent chunk count / size / round / sender / digest
    for change in (
        {"count": envs[0].count + 1},
        {"total_size": 999},
        {"round": 3},
        {"sender": "c2"},
        {"digest": "0" * 64},
    ):
        with pytest.raises(WireError, match="disagrees"):
            r.add(Envelope(**{**envs[2].__dict__, **change}))
    # more bytes than declared
    big = Envelope(**{**envs[2].__dict__, "body": envs[2].body + b"x" * 1000})
    with pytest.raises(WireError, match="more than the declared"):
        r.add(big)
    for e in envs[2:]:
        r.add(e)
    assert r.blob() == blob  # the rejected chunks left no trace


def test_digest_mismatch_and_bad_sizes_are_caught_at_the_end() -> None:
    blob = _blob(1000)
    bad = _chunks(blob, digest="0" * 64)
    r = Reassembler()
    for e in bad:
        r.add(e)
    with pytest.raises(WireError, match="digest"):
        r.blob()
    # chunks that add up to less than the declared size
    envs = _chunks(blob)
    short = [Envelope(**{**e.__dict__, "total_size": 1100}) for e in envs]
    r = Reassembler()
    with pytest.raises(WireError, match="declared"):
        for e in short:
            r.add(e)


def test_reassembler_and_collector_bound_memory() -> None:
    envs = _chunks(_blob(5000), size=600)
    with pytest.raises(WireError, match="limits"):
        Reassembler(WireLimits(max_blob_bytes=4999)).add(envs[0])
    with pytest.raises(WireError, match="limits"):
        Reassembler(WireLimits(max_chunks=len(envs) - 1)).add(envs[0])
    c = ChunkCollector(max_pending_bytes=2000)
    with pytest.raises(WireError, match="more than 2000"):
        for e in envs:
            c.add(e)
    assert c.pending_bytes <= 2000
    dropped: list[tuple[str, str]] = []
    c = ChunkCollector(max_pending_blobs=2, on_drop=lambda key, held, count, why: dropped.append((key[4], why)))
    firsts = [_chunks(_blob(900, i), sender=s)[0] for i, s in ((1, "c1"), (2, "c1"), (3, "c2"))]
    for e in firsts:
        c.add(e)
    # the count is full: the sender holding the most blobs loses its oldest, the newcomer is not refused
    assert [k[4] for k in c.keys()] == [firsts[1].digest, firsts[2].digest]
    assert dropped == [(firsts[0].digest, dropped[0][1])] and "max_pending_blobs" in dropped[0][1]


def _first_chunks(sender: str, n: int, seed: int) -> list[Envelope]:
    """The first chunk (900 of 1000 bytes) of ``n`` blobs of ``sender``, which never finish."""
    return [_chunks(_blob(1000, seed + i), size=900 + header_size("fed", sender), sender=sender)[0]
            for i in range(n)]


def test_a_flood_of_unfinished_blobs_does_not_starve_another_sender() -> None:
    """One sender fills the whole budget (alone, its share is all of it); another sender's chunks are still
    taken -- the flooder's oldest blobs make room -- and never refused; the flooder is held to its share."""
    dropped: list[tuple[str, str]] = []
    c = ChunkCollector(max_pending_bytes=3000, min_share=1000,
                       on_drop=lambda key, held, count, why: dropped.append((key[2], why)))
    for e in _first_chunks("evil", 3, 0):
        c.add(e)
    assert c.pending_bytes == 2700 and c.share("evil") == 3000 and c.share("good") == 1500
    blob = _blob(1000, 99)
    first, second = _chunks(blob, size=900 + header_size("fed", "good"), sender="good")
    assert c.add(first) is None  # 3600 > 3000: room is made by dropping evil's oldest, not by refusing good
    assert dropped == [("evil", dropped[0][1])] and "evil holds the most" in dropped[0][1]
    for e in _first_chunks("evil", 3, 10):  # more flood while good's blob is unfinished
        c.add(e)
        assert c.held_by("evil") <= c.share("evil") == 1500
    assert c.missing(first.blob_key) == [1] and {s for s, _ in dropped} == {"evil"}
    assert any("over its share" in why for _, why in dropped)
    assert c.add(second) == blob and c.pending_bytes == c.held_by("evil") <= 1500


def test_a_blob_over_its_senders_share_is_refused() -> None:
    c = ChunkCollector(max_pending_bytes=3000, min_share=1000)
    c.add(_first_chunks("good", 1, 0)[0])
    big = _chunks(_blob(2000, 5), size=900 + header_size("fed", "evil"), sender="evil")
    c.add(big[0])
    with pytest.raises(WireError, match="its share of max_pending_bytes"):
        c.add(big[1])  # 1800 > its share of 1500 (two senders)
    assert c.held_by("good") == 900 and c.held_by("evil") == 900


def test_collector_routes_interleaved_blobs() -> None:
    blobs = {f"c{i}": _blob(2000 + 37 * i, i) for i in range(4)}
    streams = [(s, e) for s, b in blobs.items() for e in _chunks(b, sender=s)]
    np.random.default_rng(5).shuffle(streams)  # type: ignore[arg-type,unused-ignore]
    c = ChunkCollector()
    done = {}
    for sender, env in streams:
        out = c.add(env)
        if out is not None:
            done[sender] = out
    assert done == blobs and c.keys() == [] and c.pending_bytes == 0


@pytest.mark.parametrize(
    "topic_of, ok",
    [
        (lambda t, e: t.update_chunk("c1", 2, e.index), True),
        (lambda t, e: t.update_chunk("c2", 2, e.index), False),  # a client posting under another's name
        (lambda t, e: t.update_chunk("c1", 3, e.index), False),
        (lambda t, e: t.update_chunk("c1", 2, e.index + 1), False),
        (lambda t, e: t.model_chunk(e.digest, e.index), False),
        (lambda t, e: t.status("c1"), False),
    ],
)
def test_check_topic(topic_of: Any, ok: bool) -> None:
    t = Topics("fed")
    env = _chunks(_blob(700))[1]
    if ok:
        check_topic(env, t.parse(topic_of(t, env)))
    else:
        with pytest.raises(WireError):
            check_topic(env, t.parse(topic_of(t, env)))


def test_encode_side_errors() -> None:
    with pytest.raises(EncodeError):
        chunk_blob(b"abc", Kind.MODEL_CHUNK, "fed", "coord", 1, header_size("fed", "coord"))
    with pytest.raises(EncodeError):
        mqtt_payload_limit(20, 30)
    with pytest.raises(EncodeError):
        Envelope(Kind.PLAN, "fed", "bad id", 1, 0, 1, 1, "0" * 64, b"x").encode()
    with pytest.raises(EncodeError):
        Envelope(Kind.PLAN, "fed", "c", 1, 1, 1, 1, "0" * 64, b"x").encode()
