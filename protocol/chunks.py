"""Chunking a blob into envelope payloads that fit the broker, and putting it back together.

Sizes. An MQTT PUBLISH packet is a fixed header (1 byte + a 1-4 byte "remaining length"), the topic
(2-byte length + UTF-8), a 2-byte packet id at QoS 1/2, MQTT 5 properties (a length varint + the
properties; none on 3.1.1), then the payload. Mosquitto disconnects (or, for ``message_size_limit``,
silently drops) anything larger than its limits, and paho-mqtt does not check, so the sender must:
:func:`mqtt_payload_limit` gives the largest payload for a packet limit and topic,
:func:`max_body_per_chunk` the largest chunk body once the envelope header is paid, and
:func:`chunk_blob` cuts a blob into payloads of at most a given size.

Reassembly. :class:`Reassembler` collects the chunks of one blob: in any order, identical
duplicates ignored, a duplicate index with different bytes rejected, chunks whose kind / ids /
round / count / size / digest disagree with the first one rejected, never more bytes held than the
declared size (itself within the limits); :meth:`Reassembler.missing` lists what is still to come
and :meth:`Reassembler.blob` returns the blob only once its sha256 matches the digest.
:class:`ChunkCollector` routes chunks of many blobs (a coordinator receiving every client's upload)
to their reassemblers under a memory budget, shared out by sender so that one sender's unfinished
blobs cannot crowd out another's (rules in its docstring).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable

from .envelope import Envelope, Kind, header_size
from .errors import EncodeError, WireError
from .limits import DEFAULT_LIMITS, WireLimits
from .signing import SigningKey

__all__ = ["ChunkCollector", "Reassembler", "chunk_blob", "max_body_per_chunk", "mqtt_payload_limit"]

MQTT_MAX_REMAINING_LENGTH = 268_435_455


def _varint_len(n: int) -> int:
    return 1 if n < 128 else 2 if n < 16_384 else 3 if n < 2_097_152 else 4


def mqtt_payload_limit(max_packet_size: int, topic_length: int, qos: int = 1,
                       mqtt5_properties: int | None = None) -> int:
    """The largest payload of a PUBLISH packet of at most ``max_packet_size`` bytes.

    ``topic_length``: UTF-8 bytes of the (longest) topic; ``mqtt5_properties``: bytes of MQTT 5
    properties, or None on MQTT 3.1.1. Raises EncodeError when nothing fits.
    """
    if qos not in (0, 1, 2) or topic_length < 1 or max_packet_size < 1:
        raise EncodeError(f"bad qos {qos}, topic length {topic_length} or packet size {max_packet_size}")
    variable = 2 + topic_length + (2 if qos else 0)
    if mqtt5_properties is not None:
        variable += _varint_len(mqtt5_properties) + mqtt5_properties
    best = -1
    for vl in (1, 2, 3, 4):
        remaining = min(max_packet_size - 1 - vl, MQTT_MAX_REMAINING_LENGTH)
        if remaining >= 0 and _varint_len(remaining) <= vl:
            best = max(best, remaining - variable)
    if best < 1:
        raise EncodeError(f"a {max_packet_size}-byte packet leaves no room for a payload on this topic")
    return best


def max_body_per_chunk(max_packet_size: int, topic_length: int, federation: str, sender: str, qos: int = 1,
                       mqtt5_properties: int | None = None) -> int:
    """The largest chunk body whose envelope still fits a ``max_packet_size`` PUBLISH packet."""
    payload = mqtt_payload_limit(max_packet_size, topic_length, qos, mqtt5_properties)
    body = payload - header_size(federation, sender)
    if body < 1:
        raise EncodeError(f"a {max_packet_size}-byte packet leaves no room for a chunk body")
    return body


def chunk_blob(blob: bytes, kind: Kind, federation: str, sender: str, round_: int, max_payload: int,
               digest: str | None = None, key: SigningKey | None = None) -> list[bytes]:
    """Envelope payloads of at most ``max_payload`` bytes each (header included) carrying ``blob``, each
    signed with ``key`` (the sender's; receivers refuse unsigned chunks).

    ``digest`` (sha256 hex of ``blob``) is computed when not given.
    """
    body_size = max_payload - header_size(federation, sender)
    if body_size < 1:
        raise EncodeError(f"max_payload {max_payload} leaves no room for a chunk body")
    digest = digest or hashlib.sha256(blob).hexdigest()
    count = max(1, -(-len(blob) // body_size))
    if count >= 2**32:
        raise EncodeError("blob needs too many chunks")
    view = memoryview(blob)
    return [Envelope(kind, federation, sender, round_, i, count, len(blob), digest,
                     bytes(view[i * body_size:(i + 1) * body_size])).encode(key) for i in range(count)]


class Reassembler:
    """The chunks of one blob (see module docstring). The first chunk fixes the blob's identity."""

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._first: Envelope | None = None
        self._parts: dict[int, bytes] = {}
        self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def held_chunks(self) -> int:
        return len(self._parts)

    @property
    def count(self) -> int:
        """Chunks of the blob (0 until the first chunk arrived)."""
        return self._first.count if self._first is not None else 0

    @property
    def complete(self) -> bool:
        return self._first is not None and len(self._parts) == self._first.count

    def holds(self, index: int) -> bool:
        """True when chunk ``index`` is already in (a re-sent copy adds no bytes)."""
        return index in self._parts

    def missing(self) -> list[int]:
        """Chunk indices not yet received (empty before the first chunk: the count is unknown)."""
        if self._first is None:
            return []
        return [i for i in range(self._first.count) if i not in self._parts]

    def add(self, env: Envelope) -> bool:
        """Add one chunk; True once every chunk is in. WireError (state unchanged) for a chunk that
        does not belong, conflicts with one already held, or would exceed the declared size."""
        first = self._first
        if first is None:
            cap = self.limits.max_json_bytes if env.kind not in (Kind.MODEL_CHUNK, Kind.UPDATE_CHUNK) \
                else self.limits.max_blob_bytes
            if env.total_size > cap or env.count > self.limits.max_chunks:
                raise WireError(f"blob of {env.total_size} bytes in {env.count} chunks exceeds the limits")
        elif (env.blob_key, env.count, env.total_size) != (first.blob_key, first.count, first.total_size):
            raise WireError(f"chunk {env.index} disagrees with the blob's first chunk "
                            "(kind, ids, round, digest, count or size)")
        if not 0 <= env.index < env.count:
            raise WireError(f"chunk index {env.index} outside [0, {env.count})")
        held = self._parts.get(env.index)
        if held is not None:
            if held != env.body:
                raise WireError(f"chunk {env.index} arrived twice with different bytes")
            return self.complete
        if not env.body and env.total_size:
            raise WireError(f"chunk {env.index} is empty")
        if self._held + len(env.body) > env.total_size:
            raise WireError(f"chunks hold more than the declared {env.total_size} bytes")
        if len(self._parts) + 1 == env.count and self._held + len(env.body) != env.total_size:
            raise WireError(f"chunks hold {self._held + len(env.body)} bytes, declared {env.total_size}")
        self._first = first or env
        self._parts[env.index] = env.body
        self._held += len(env.body)
        return self.complete

    def blob(self) -> bytes:
        """The whole blob, checked against its sha256 digest; WireError if incomplete or corrupt."""
        if self._first is None or not self.complete:
            missing = self.missing()
            raise WireError(f"blob incomplete: {len(missing) if self._first else 'all'} chunks missing "
                            f"(first: {missing[:10]})")
        data = b"".join(self._parts[i] for i in range(self._first.count))
        if hashlib.sha256(data).hexdigest() != self._first.digest:
            raise WireError("reassembled blob does not match its sha256 digest")
        return data


BlobKey = tuple[int, str, str, int, str]  # Envelope.blob_key: kind, federation, sender, round, digest
OnDrop = Callable[[BlobKey, int, int, str], None]  # (key, chunks held, chunk count, why)


class ChunkCollector:
    """Reassemblers for many blobs at once, keyed by :attr:`Envelope.blob_key`, holding at most
    ``max_pending_bytes`` of chunk bodies and ``max_pending_blobs`` unfinished blobs.

    One sender cannot crowd out the others:

    1. It holds at most ``max_blobs_per_sender`` unfinished blobs; a new one evicts its oldest.
    2. It holds at most its *share* of the byte budget: ``max(max_pending_bytes // k, min_share)``
       while ``k`` senders (itself included) hold unfinished blobs. ``min_share`` is the largest blob
       an honest sender sends (default ``limits.max_blob_bytes``; never above the budget), so every
       sender can always finish one blob. A chunk that would take its sender over its share first
       drops that sender's oldest other unfinished blobs; a chunk whose own blob does not fit the
       share is refused (WireError).
    3. When the budget as a whole is full (the shares can add up to more than it), the oldest
       unfinished blob of the sender holding the most bytes is dropped, never the chunk's own blob;
       when ``max_pending_blobs`` is reached, the oldest of the sender holding the most blobs. A
       chunk within its sender's share is never refused because other senders filled the budget.

    A chunk that contradicts the chunks held for its blob (count, size, or different bytes at an
    index) starts that blob over from this chunk: one side is damaged and only the digest of a
    complete blob can tell which, so the sender's re-send always gets through. Every unfinished blob
    dropped -- evicted, over a share, started over, or :meth:`discard` -ed -- is reported to
    ``on_drop(key, chunks held, chunk count, why)``.
    """

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, max_pending_bytes: int = 1 << 30,
                 max_pending_blobs: int = 4096, max_blobs_per_sender: int = 4,
                 on_drop: OnDrop | None = None, min_share: int | None = None) -> None:
        if max_blobs_per_sender < 1:
            raise ValueError(f"max_blobs_per_sender must be >= 1, got {max_blobs_per_sender}")
        self.limits = limits
        self.max_pending_bytes = max_pending_bytes
        self.max_pending_blobs = max_pending_blobs
        self.max_blobs_per_sender = max_blobs_per_sender
        self.on_drop = on_drop
        self.min_share = min_share  # None: limits.max_blob_bytes (rule 2)
        self._blobs: dict[BlobKey, Reassembler] = {}  # insertion order: oldest first
        self._by_sender: dict[str, dict[BlobKey, None]] = {}  # each sender's unfinished blobs, oldest first
        self._sender_bytes: Counter[str] = Counter()
        self._pending = 0

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def keys(self) -> list[BlobKey]:
        return list(self._blobs)

    def missing(self, key: BlobKey) -> list[int]:
        r = self._blobs.get(key)
        return r.missing() if r is not None else []

    def held_by(self, sender: str) -> int:
        """Bytes of ``sender``'s unfinished blobs."""
        return self._sender_bytes.get(sender, 0)

    def share(self, sender: str) -> int:
        """The bytes of unfinished blobs ``sender`` may hold now (rule 2)."""
        active = len(self._by_sender) + (sender not in self._by_sender)
        floor = self.limits.max_blob_bytes if self.min_share is None else self.min_share
        return max(self.max_pending_bytes // active, min(floor, self.max_pending_bytes))

    def _put(self, key: BlobKey, r: Reassembler, held: int) -> None:
        self._blobs[key] = r
        self._by_sender.setdefault(key[2], {})[key] = None
        self._sender_bytes[key[2]] += held
        self._pending += held

    def _forget(self, key: BlobKey) -> Reassembler | None:
        r = self._blobs.pop(key, None)
        if r is None:
            return None
        sender = key[2]
        mine = self._by_sender[sender]
        del mine[key]
        self._sender_bytes[sender] -= r.held_bytes
        if not mine:
            del self._by_sender[sender], self._sender_bytes[sender]
        self._pending -= r.held_bytes
        return r

    def _drop(self, key: BlobKey, why: str) -> None:
        r = self._forget(key)
        if r is not None and self.on_drop is not None:
            self.on_drop(key, r.held_chunks, r.count, why)

    def discard(self, keys: Iterable[BlobKey], why: str = "discarded") -> None:
        for key in list(keys):
            self._drop(key, why)

    def _make_room(self, sender: str) -> None:
        """Rule 1, and the count of unfinished blobs (rule 3): before a new blob of ``sender``."""
        mine = list(self._by_sender.get(sender, ()))
        for key in mine[:max(0, len(mine) - self.max_blobs_per_sender + 1)]:
            self._drop(key, f"{sender} started more than {self.max_blobs_per_sender} unfinished blobs; the "
                            "oldest is evicted")
        while self._blobs and len(self._blobs) >= self.max_pending_blobs:
            most = max(self._by_sender, key=lambda s: len(self._by_sender[s]))
            self._drop(next(iter(self._by_sender[most])), f"{self.max_pending_blobs} unfinished blobs are held "
                                                          f"(max_pending_blobs); {most} holds the most")

    def _fit(self, key: BlobKey, n: int) -> None:
        """Room for ``n`` more bytes of blob ``key`` (rules 2 and 3), or WireError."""
        sender = key[2]
        share = self.share(sender)
        for old in [k for k in self._by_sender.get(sender, ()) if k != key]:
            if self.held_by(sender) + n <= share:
                break
            self._drop(old, f"{sender} went over its share of max_pending_bytes ({share} bytes); its oldest "
                            "unfinished blob is dropped")
        if self.held_by(sender) + n > share:
            raise WireError(f"unfinished blobs of {sender} would hold more than {share} bytes, its share of "
                            f"max_pending_bytes ({self.max_pending_bytes})")
        while self._pending + n > self.max_pending_bytes:
            victims = [k for s in sorted(self._by_sender, key=self.held_by, reverse=True)
                       for k in self._by_sender[s] if k != key]
            if not victims:  # cannot happen: the sender's own bytes fit its share, which fits the budget
                raise WireError(f"unfinished blobs would hold more than {self.max_pending_bytes} bytes")
            self._drop(victims[0], f"max_pending_bytes ({self.max_pending_bytes}) is full; {victims[0][2]} "
                                   "holds the most, its oldest unfinished blob is dropped")

    def add(self, env: Envelope) -> bytes | None:
        """Add a chunk; the verified blob when it completes one (which is then forgotten), else None.
        WireError for a bad chunk; a completed blob that fails its digest is dropped as well."""
        key = env.blob_key
        r = self._blobs.get(key)
        if r is None:
            self._make_room(env.sender)
            r = Reassembler(self.limits)
        self._fit(key, 0 if r.holds(env.index) else len(env.body))
        before = r.held_bytes
        try:
            done = r.add(env)
        except WireError as exc:
            if key not in self._blobs:
                raise
            self._drop(key, f"chunk {env.index} contradicts it ({exc.reason}); the blob starts over")
            r, before = Reassembler(self.limits), 0
            done = r.add(env)
        if key in self._blobs:
            self._sender_bytes[env.sender] += r.held_bytes - before
            self._pending += r.held_bytes - before
        else:
            self._put(key, r, r.held_bytes)
        if not done:
            return None
        self._forget(key)
        return r.blob()
