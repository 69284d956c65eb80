"""The wire: topic names, the message envelope, dense model blobs and chunking, the sparse-update
codec and the small JSON messages. Bytes in, bytes out, no network.

Every decoder validates what it reads and raises :class:`WireError` (one type, a ``reason``) for
anything malformed; encoders raise :class:`EncodeError` for bad local input. See
docs/reference/wire.md for the byte layouts.
"""

from .blobs import STATE_DTYPES, blob_digest, decode_state, encode_state
from .chunks import ChunkCollector, Reassembler, chunk_blob, max_body_per_chunk, mqtt_payload_limit
from .envelope import Codec, Envelope, Kind, Trust, check_topic, decode_envelope, header_size
from .errors import EncodeError, InvalidUpdate, WireError
from .limits import DEFAULT_LIMITS, WireLimits
from .messages import Ack, Message, Metrics, Plan, Status, decode_message, encode_message, parse_message
from .signing import KeyRing, PeerTrust, SignatureError, SignContext, SigningKey, VerifyKey
from .sparse import Method, entropy_bits
from .topics import ParsedTopic, TopicError, Topics, acl_rules, validate_id
from .update_codec import (
    DecodedUpdate,
    UpdateHead,
    UpdateHeader,
    UpdateOptions,
    decode_update,
    encode_update,
    payload_bound,
    read_update_head,
    update_sizer,
)
from .values import VALUE_CODECS, ValueCodec

__all__ = [
    "DEFAULT_LIMITS",
    "STATE_DTYPES",
    "VALUE_CODECS",
    "Ack",
    "ChunkCollector",
    "Codec",
    "DecodedUpdate",
    "EncodeError",
    "Envelope",
    "InvalidUpdate",
    "KeyRing",
    "Kind",
    "Message",
    "Method",
    "Metrics",
    "ParsedTopic",
    "PeerTrust",
    "Plan",
    "Reassembler",
    "SignContext",
    "SignatureError",
    "SigningKey",
    "Status",
    "TopicError",
    "Topics",
    "Trust",
    "UpdateHead",
    "UpdateHeader",
    "UpdateOptions",
    "ValueCodec",
    "VerifyKey",
    "WireError",
    "WireLimits",
    "acl_rules",
    "blob_digest",
    "check_topic",
    "chunk_blob",
    "decode_envelope",
    "decode_message",
    "decode_state",
    "decode_update",
    "encode_message",
    "encode_state",
    "encode_update",
    "entropy_bits",
    "header_size",
    "max_body_per_chunk",
    "mqtt_payload_limit",
    "parse_message",
    "payload_bound",
    "read_update_head",
    "update_sizer",
    "validate_id",
]
