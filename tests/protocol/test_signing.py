"""Signed envelopes (protocol.signing, protocol.envelope): what a receiver holding the sender's key accepts."""

from __future__ import annotations

import hashlib

import pytest

from protocol import (
    Ack,
    Envelope,
    KeyRing,
    Kind,
    PeerTrust,
    SignatureError,
    SignContext,
    SigningKey,
    VerifyKey,
    WireError,
    chunk_blob,
    decode_envelope,
    decode_message,
    encode_message,
    header_size,
)
from protocol.signing import key_problem, parse_key_registry, render_key_registry

KEY, OTHER = SigningKey.generate(), SigningKey.generate()
ACK = Ack(3, "dev-1", "ab" * 32, "accepted")


def test_a_signed_message_verifies_with_the_senders_key_only() -> None:
    payload = encode_message(ACK, "fed", "coord", key=KEY)
    assert decode_message(payload, trust=PeerTrust("fed", KEY.public))[1] == ACK
    for trust in (PeerTrust("fed", OTHER.public), KeyRing("fed", {"coord": OTHER.public}), KeyRing("fed", {})):
        with pytest.raises(SignatureError):
            decode_message(payload, trust=trust)
    with pytest.raises(SignatureError, match="federation"):
        decode_message(payload, trust=PeerTrust("other", KEY.public))
    with pytest.raises(SignatureError, match="bad signature"):  # unsigned: all-zero signature field
        decode_message(encode_message(ACK, "fed", "coord"), trust=PeerTrust("fed", KEY.public))


def test_every_byte_of_header_and_body_is_covered() -> None:
    payload = encode_message(ACK, "fed", "coord", key=KEY)
    trust = PeerTrust("fed", KEY.public)
    for i in range(len(payload)):
        bad = bytearray(payload)
        bad[i] ^= 0x01
        with pytest.raises(WireError):
            decode_envelope(bytes(bad), trust=trust)


def test_each_chunk_is_signed_and_bound_to_its_kind_round_and_sender() -> None:
    blob = bytes(range(256)) * 40
    chunks = chunk_blob(blob, Kind.MODEL_CHUNK, "fed", "coord", 4, 3000, key=KEY)
    trust = PeerTrust("fed", KEY.public)
    assert len(chunks) > 3 and all(decode_envelope(c, trust=trust).index == i for i, c in enumerate(chunks))
    env = decode_envelope(chunks[0])
    digest = hashlib.sha256(blob).hexdigest()
    moved = [Envelope(Kind.UPDATE_CHUNK, "fed", "coord", 4, 0, env.count, len(blob), digest, env.body, env.signature),
             Envelope(Kind.MODEL_CHUNK, "fed", "coord", 5, 0, env.count, len(blob), digest, env.body, env.signature),
             Envelope(Kind.MODEL_CHUNK, "fed", "dev-1", 4, 0, env.count, len(blob), digest, env.body, env.signature),
             Envelope(Kind.MODEL_CHUNK, "fed", "coord", 4, 1, env.count, len(blob), digest, env.body, env.signature)]
    for e in moved:  # the signature taken to another kind, round, sender or position
        with pytest.raises(SignatureError):
            decode_envelope(e.encode(), trust=KeyRing("fed", {"coord": KEY.public, "dev-1": KEY.public}))


def test_an_earlier_releases_envelope_is_refused_naming_the_version_needed() -> None:
    payload = bytearray(encode_message(ACK, "fed", "coord", key=KEY))
    payload[4] = 1
    with pytest.raises(WireError, match="format version 1 .* needs envelope format version 2"):
        decode_envelope(bytes(payload))
    assert header_size("fed", "coord") == 70 + 3 + 5 + 64


def test_context_binding_and_key_text() -> None:
    ctx = SignContext("fed", 7, "dev-3", "secagg:consistency")
    sig = KEY.sign(ctx, b"transcript")
    KEY.public.verify(ctx, b"transcript", sig)
    for other in (SignContext("fed2", 7, "dev-3", ctx.purpose), SignContext("fed", 8, "dev-3", ctx.purpose),
                  SignContext("fed", 7, "dev-4", ctx.purpose), SignContext("fed", 7, "dev-3", "other")):
        with pytest.raises(SignatureError):
            KEY.public.verify(other, b"transcript", sig)
    with pytest.raises(SignatureError):
        KEY.public.verify(ctx, b"transcripT", sig)
    again = SigningKey.from_text(KEY.private_text())
    assert again.public == KEY.public == VerifyKey.from_text(KEY.public.text)
    assert KEY.private_text() not in repr(KEY)
    for bad in ("", "ed25519:", "ed25519:!!!", "rsa:AAAA", "ed25519:" + "A" * 10, 5):
        assert key_problem(bad, private=False) is not None and key_problem(bad, private=True) is not None


def test_key_registry_round_trip_and_bad_input() -> None:
    text = render_key_registry(KEY.public, {"dev-1": OTHER.public})
    assert parse_key_registry(text) == (KEY.public, {"dev-1": OTHER.public})
    for bad in ("[]", "{", '{"devices": {"bad id!": "x"}}', '{"devices": {"d": "ed25519:AA"}}', '{"x": 1}'):
        with pytest.raises(SignatureError):
            parse_key_registry(bad)
