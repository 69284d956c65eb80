"""The envelope every MQTT payload of the federation travels in.

Layout (little-endian, 134 + F + S header bytes, then the body)::

    offset  size  field
    0       4     magic "FLEW"
    4       1     format version (2; 1 was the earlier release's, unsigned: refused with the version needed)
    5       1     kind   (1 model_chunk, 2 update_chunk, 3 plan, 4 ack, 5 status, 6 metrics, 7 secagg)
    6       1     codec  (1 json, 2 safetensors, 3 sparse_update, 4 secagg): how the whole blob is encoded
    7       1     flags  (0; reserved)
    8       4     round
    12      4     chunk index i (< n)
    16      4     chunk count n (>= 1)
    20      8     size of the whole blob (all chunks' bodies together)
    28      4     body length (must equal the bytes that follow the header)
    32      4     crc32 of the body (zlib's CRC-32; catches corruption of one chunk)
    36      32    sha256 of the whole blob (authoritative end-to-end check; names model blobs)
    68      1     federation length F   69  1  sender length S
    70      F+S   federation id, sender id (1-64 ASCII characters of [A-Za-z0-9_-] each)
    70+F+S  64    Ed25519 signature of the sender over everything else: the header without this field and
                  the body's sha256 (:func:`signed_data`; :mod:`protocol.signing`, purpose ``envelope/<kind>``,
                  bound to the federation, round and sender of the header)

Every envelope is signed, chunk by chunk: a receiver given a :class:`Trust` (``decode_envelope(payload,
trust=...)``) checks the signature against the key it holds for the sender before it looks at the body, so
nothing the sender did not sign -- a forged plan, ack, chunk or update, a message moved to another
federation, round, sender or kind -- gets past it, whatever path it came by.

Nothing depends on MQTT 5 properties, so the same bytes work on MQTT 3.1.1 brokers. The kind
fixes the codec (model_chunk: safetensors, update_chunk: sparse_update, secagg: secagg, the rest: json)
and the JSON and secagg kinds are single-chunk. In a secure round the update blob is the device's masked
input (``flayer.secagg.MaskedInput``), carried as update chunks (docs/explanation/secure-aggregation.md). A single-chunk envelope's digest is checked on decode; multi-chunk
blobs are checked by :mod:`protocol.chunks` once complete.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from ._reader import Reader
from .errors import EncodeError, WireError
from .limits import DEFAULT_LIMITS, WireLimits
from .signing import SIGNATURE_BYTES, SignatureError, SignContext, SigningKey, VerifyKey
from .topics import ParsedTopic, TopicError, validate_id

__all__ = [
    "ENVELOPE_MAGIC",
    "ENVELOPE_VERSION",
    "KIND_CODEC",
    "Codec",
    "Envelope",
    "Kind",
    "Trust",
    "check_topic",
    "decode_envelope",
    "header_size",
]

ENVELOPE_MAGIC = b"FLEW"
ENVELOPE_VERSION = 2
_FIXED = struct.Struct("<4sBBBBIIIQII32sBB")
_DIGEST = re.compile(r"[0-9a-f]{64}")


class Kind(IntEnum):
    MODEL_CHUNK = 1
    UPDATE_CHUNK = 2
    PLAN = 3
    ACK = 4
    STATUS = 5
    METRICS = 6
    SECAGG = 7  # a secure round's protocol message (flayer.secagg), either way: secagg/<client>, secreq/<client>


class Codec(IntEnum):
    JSON = 1
    SAFETENSORS = 2
    SPARSE_UPDATE = 3
    SECAGG = 4  # flayer.secagg's own versioned binary layout, checked by flayer.secagg.decode_message


KIND_CODEC = {Kind.MODEL_CHUNK: Codec.SAFETENSORS, Kind.UPDATE_CHUNK: Codec.SPARSE_UPDATE,
              Kind.PLAN: Codec.JSON, Kind.ACK: Codec.JSON, Kind.STATUS: Codec.JSON, Kind.METRICS: Codec.JSON,
              Kind.SECAGG: Codec.SECAGG}
SINGLE_CHUNK = frozenset({Codec.JSON, Codec.SECAGG})  # kinds whose messages travel whole, bounded by max_json_bytes


def header_size(federation: str, sender: str) -> int:
    """Envelope header bytes for these ids (the body follows)."""
    return _FIXED.size + len(federation.encode("ascii")) + len(sender.encode("ascii")) + SIGNATURE_BYTES


class Trust(Protocol):
    """Who a receiver believes: the key it holds for a sender of a federation."""

    def key_for(self, federation: str, sender: str) -> VerifyKey:
        """The sender's public key; SignatureError when this side believes nothing from it."""


def _context(kind: Kind, federation: str, sender: str, round_: int) -> SignContext:
    return SignContext(federation, round_, sender, f"envelope/{kind.name.lower()}")


def signed_data(header: bytes, body: bytes, count: int) -> bytes:
    """What an envelope's signature covers: its header without the signature field, then the body's sha256 --
    for a single-chunk message the header's digest field already is that (checked on decode), so it is not
    repeated; a chunk of a larger blob appends its own body's. Hash, then sign: the whole message is covered
    while Ed25519 hashes a few hundred bytes, not each megabyte chunk twice."""
    return header if count == 1 else header + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class Envelope:
    kind: Kind
    federation: str
    sender: str
    round: int
    index: int
    count: int
    total_size: int  # bytes of the whole blob
    digest: str  # sha256 hex of the whole blob
    body: bytes
    signature: bytes = bytes(SIGNATURE_BYTES)  # the sender's (all zero: unsigned, refused by every receiver)

    @property
    def codec(self) -> Codec:
        return KIND_CODEC[self.kind]

    @property
    def blob_key(self) -> tuple[int, str, str, int, str]:
        """What identifies the blob this chunk belongs to."""
        return (int(self.kind), self.federation, self.sender, self.round, self.digest)

    def encode(self, key: SigningKey | None = None) -> bytes:
        """The payload bytes, signed with ``key`` (the sender's; None: the envelope's own signature field, all
        zero unless set); raises EncodeError for fields the format cannot carry."""
        try:
            validate_id(self.federation, "federation id")
            validate_id(self.sender, "sender id")
        except TopicError as exc:
            raise EncodeError(str(exc)) from None
        if self.kind not in KIND_CODEC:
            raise EncodeError(f"unknown kind {self.kind!r}")
        if not (0 <= self.round < 2**32 and 0 <= self.index < self.count < 2**32
                and 0 <= self.total_size < 2**63):
            raise EncodeError(f"round {self.round}, chunk {self.index}/{self.count} or size "
                              f"{self.total_size} out of range")
        if not _DIGEST.fullmatch(self.digest):
            raise EncodeError(f"digest {self.digest!r} must be 64 lowercase hex characters")
        if len(self.body) >= 2**32:
            raise EncodeError("envelope body too large")
        fed, snd = self.federation.encode("ascii"), self.sender.encode("ascii")
        head = _FIXED.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, int(self.kind), int(self.codec), 0, self.round,
                           self.index, self.count, self.total_size, len(self.body), zlib.crc32(self.body),
                           bytes.fromhex(self.digest), len(fed), len(snd))
        if key is None:
            if len(self.signature) != SIGNATURE_BYTES:
                raise EncodeError(f"signature of {len(self.signature)} bytes (expected {SIGNATURE_BYTES})")
            return head + fed + snd + bytes(self.signature) + bytes(self.body)
        try:
            sig = key.sign(_context(self.kind, self.federation, self.sender, self.round),
                           signed_data(head + fed + snd, self.body, self.count))
        except SignatureError as exc:
            raise EncodeError(exc.reason) from None
        return head + fed + snd + sig + bytes(self.body)


def decode_envelope(payload: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS,
                    trust: Trust | None = None) -> Envelope:
    """Parse and check one payload (see module docstring); WireError for anything invalid. With ``trust``,
    SignatureError (a WireError) unless the sender's key, as ``trust`` holds it, signed the payload."""
    r = Reader(payload, "envelope")
    (magic, version, kind, codec, flags, round_, index, count, total, body_len, crc, digest, flen,
     slen) = _FIXED.unpack(r.take(_FIXED.size, "header"))
    if magic != ENVELOPE_MAGIC:
        raise WireError(f"envelope: bad magic {magic!r}")
    if version != ENVELOPE_VERSION:
        older = " (an earlier release's, unsigned)" if version < ENVELOPE_VERSION else ""
        raise WireError(f"envelope: format version {version}{older} refused: this release needs envelope format "
                        f"version {ENVELOPE_VERSION} (signed messages); upgrade the sender")
    if kind not in KIND_CODEC:
        raise WireError(f"envelope: unknown kind {kind}")
    kind = Kind(kind)
    if codec != KIND_CODEC[kind]:
        raise WireError(f"envelope: codec {codec} is not the codec of {kind.name.lower()} "
                        f"({int(KIND_CODEC[kind])})")
    if flags:
        raise WireError(f"envelope: unknown flags {flags:#04x}")
    if not 1 <= count <= limits.max_chunks or index >= count:
        raise WireError(f"envelope: chunk {index} of {count} (limit {limits.max_chunks} chunks)")
    max_total = limits.max_json_bytes if KIND_CODEC[kind] in SINGLE_CHUNK else limits.max_blob_bytes
    if total > max_total:
        raise WireError(f"envelope: blob of {total} bytes exceeds the limit {max_total}")
    if KIND_CODEC[kind] in SINGLE_CHUNK and count != 1:
        raise WireError(f"envelope: {kind.name.lower()} messages are single-chunk, got {count} chunks")
    try:
        federation = validate_id(r.text(flen, "federation", ascii_only=True), "federation id")
        sender = validate_id(r.text(slen, "sender", ascii_only=True), "sender id")
    except TopicError as exc:
        raise WireError(f"envelope: {exc}") from None
    signature = bytes(r.take(SIGNATURE_BYTES, "signature"))
    if body_len != r.remaining:
        raise WireError(f"envelope: body length {body_len} but {r.remaining} bytes follow the header")
    if body_len > total or (count == 1 and body_len != total) or (body_len == 0 and total != 0):
        raise WireError(f"envelope: body of {body_len} bytes inconsistent with a {total}-byte blob "
                        f"in {count} chunks")
    body = bytes(r.rest())
    if trust is not None:
        start = _FIXED.size + flen + slen
        trust.key_for(federation, sender).verify(_context(kind, federation, sender, round_),
                                                 signed_data(bytes(payload[:start]), body, count), signature)
    if zlib.crc32(body) != crc:
        raise WireError(f"envelope: chunk {index} checksum mismatch (corrupted body)")
    if count == 1 and hashlib.sha256(body).digest() != digest:
        raise WireError("envelope: body does not match its sha256 digest")
    return Envelope(kind, federation, sender, round_, index, count, total, digest.hex(), body, signature)


_TOPIC_KIND = {"model": Kind.MODEL_CHUNK, "update": Kind.UPDATE_CHUNK, "round": Kind.PLAN, "ack": Kind.ACK,
               "status": Kind.STATUS, "metrics": Kind.METRICS, "secagg": Kind.SECAGG, "secreq": Kind.SECAGG}


def check_topic(env: Envelope, topic: ParsedTopic) -> None:
    """WireError unless ``env`` may travel on ``topic`` (parsed with :meth:`Topics.parse`): same kind;
    model chunks: same digest and index; update chunks: sender = topic's client, same round and
    index; status and metrics: sender = topic's client (the broker's ACL ties the topic's client id
    to the connecting user, so this ties the envelope to it too)."""
    if _TOPIC_KIND.get(topic.kind) != env.kind:
        raise WireError(f"envelope of kind {env.kind.name.lower()} on a {topic.kind} topic")
    if topic.kind == "model" and (topic.digest != env.digest or topic.chunk != env.index):
        raise WireError("model chunk: digest or index differs from its topic")
    if topic.kind == "update" and (topic.client != env.sender or topic.round != env.round
                                   or topic.chunk != env.index):
        raise WireError("update chunk: sender, round or index differs from its topic")
    if topic.kind in ("status", "metrics", "secagg") and topic.client != env.sender:
        raise WireError(f"{topic.kind}: sender {env.sender!r} is not the topic's client {topic.client!r}")
