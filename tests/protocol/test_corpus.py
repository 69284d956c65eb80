"""A hand-made corpus of hostile payloads: each must raise WireError, with the reason it names.

Built field by field with ``_wirecraft`` (from the documented layouts), so every case is exactly
the fault it claims to be: truncation at every byte, lengths that overflow, positions out of range,
malformed position streams, NaN and Inf, wrong versions / codecs / dtypes, checksum and digest
mismatches. Unsorted or repeated positions cannot be written in the position formats (Rice codes
gaps >= 1, a bitmask is a set), so the encoder refuses them (test_update_codec) and the decoder sees
them only as count mismatches or out-of-range sums, which are here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard
from _wirecraft import bitmask, envelope, rice_reference, tensor_record, update_blob

from flayer.update import TensorDelta, Update
from protocol import (
    Ack,
    Plan,
    Reassembler,
    UpdateHeader,
    UpdateOptions,
    WireError,
    chunk_blob,
    decode_envelope,
    decode_message,
    decode_state,
    decode_update,
    encode_message,
    encode_state,
    encode_update,
)
from protocol.envelope import Kind

F32 = struct.Struct("<f")


def _vals(*xs: float) -> bytes:
    return b"".join(F32.pack(x) for x in xs)


def _rec(**kw: Any) -> bytes:
    """A valid record (shape (10,), positions 2 and 7 by Rice k=1) with fields overridden."""
    base: dict[str, Any] = {
        "name": b"w",
        "shape": (10,),
        "count": 2,
        "positions": rice_reference([2, 4], 1),
        "values": _vals(0.5, -0.25),
        "k": 1,
    }
    base.update(kw)
    return tensor_record(
        base.pop("name"),
        base.pop("shape"),
        base.pop("count"),
        base.pop("positions"),
        base.pop("values"),
        **base,
    )


def test_crafted_baseline_is_valid() -> None:
    """The crafted layout is the one the decoder reads (so the cases below differ in one field only)."""
    out = decode_update(update_blob([_rec(), _rec(name=b"b", positions=bitmask([0, 9], 10), method=1, k=0)]))
    w = out.update.deltas["w"]
    assert w.indices.tolist() == [2, 7] and w.values.tolist() == [0.5, -0.25]  # type: ignore[union-attr]
    assert out.update.deltas["b"].indices.tolist() == [0, 9]  # type: ignore[union-attr]
    assert out.header == UpdateHeader("fed", 1, "c1", "11" * 32) and out.update.info == {"acc": 0.5}


def _zstd_payload(raw: bytes, declared: int | None = None, write_size: bool = True) -> bytes:
    frame = zstandard.ZstdCompressor(write_content_size=write_size).compress(raw)
    return struct.pack("<I", len(raw) if declared is None else declared) + frame


UPDATE_CASES: list[tuple[str, bytes, str]] = [
    # lengths that overflow the buffer or the limits
    ("name length 65535", update_blob([_rec(name_len=65535)]), "truncated"),
    ("ndim 255", update_blob([_rec(ndim=255)]), "dimensions"),
    ("dims 2**32-1 squared", update_blob([_rec(shape=(2**32 - 1, 2**32 - 1))]), "elements"),
    ("count 2**32-1", update_blob([_rec(count=2**32 - 1)]), "values for 10 elements"),
    ("count > numel", update_blob([_rec(count=11)]), "values for 10 elements"),
    ("positions length 2**32-1", update_blob([_rec(pos_len=2**32 - 1)]), "truncated"),
    ("values length 2**32-1", update_blob([_rec(val_len=2**32 - 1)]), "value bytes"),
    ("values length short", update_blob([_rec(val_len=4)]), "value bytes"),
    ("tensor count 2**32-1", update_blob([_rec()], ntensors=2**32 - 1), "limits"),
    ("tensor count one too many", update_blob([_rec()], ntensors=2), "truncated"),
    ("info count 65535", update_blob([_rec()], ninfo=65535), "limits"),
    ("info key length 255", update_blob([_rec()], info=[(b"k" * 255, 1.0)]), "info"),
    (
        "rice unary length 2**32-1",
        update_blob([_rec(positions=b"\xff\xff\xff\xff" + b"\x00" * 8)]),
        "exceeds",
    ),
    ("zstd raw length 2**32-1", update_blob([], flags=1, payload=_zstd_payload(_rec(), 2**32 - 1)), "limit"),
    ("trailing bytes", update_blob([_rec()], payload=_rec() + b"\x00"), "trailing"),
    # positions out of range / inconsistent with the count
    ("rice past numel", update_blob([_rec(positions=rice_reference([2, 7], 1))]), "out of range"),
    (
        "rice fewer codes",
        update_blob([_rec(count=2, positions=rice_reference([2], 1), values=_vals(1, 2))]),
        "codes",
    ),
    (
        "rice more codes",
        update_blob([_rec(count=1, positions=rice_reference([2, 1], 1), values=_vals(1))]),
        "codes",
    ),
    ("rice k 32", update_blob([_rec(k=32)]), "rice parameter"),
    (
        "bitmask count mismatch",
        update_blob([_rec(method=1, k=0, positions=bitmask([1, 2, 3], 10))]),
        "declared",
    ),
    ("bitmask padding", update_blob([_rec(method=1, k=0, positions=b"\x00\x3f")]), "padding"),
    (
        "complement past numel",
        update_blob(
            [_rec(count=8, method=3, k=0, positions=rice_reference([9, 1], 0), values=_vals(*range(8)))]
        ),
        "out of range",
    ),
    (
        "zstd bitmask bomb",
        update_blob([_rec(method=4, k=0, positions=zstandard.ZstdCompressor().compress(b"\x00" * 10**6))]),
        "frame declares",
    ),
    (
        "zstd bitmask count mismatch",
        update_blob([_rec(method=4, k=0, positions=zstandard.ZstdCompressor().compress(bitmask([2], 10)))]),
        "declared",
    ),
    ("dense with a count below numel", update_blob([_rec(method=0, k=0, positions=b"")]), "dense"),
    # NaN and Inf
    ("fp32 NaN", update_blob([_rec(values=_vals(float("nan"), 1))]), "NaN or Inf"),
    ("fp32 +Inf", update_blob([_rec(values=_vals(1, float("inf")))]), "NaN or Inf"),
    ("fp32 -Inf", update_blob([_rec(values=_vals(float("-inf"), 1))]), "NaN or Inf"),
    ("fp16 Inf", update_blob([_rec(vcodec=2, values=b"\x00\x7c\x00\x00")]), "NaN or Inf"),
    ("fp16 NaN", update_blob([_rec(vcodec=2, values=b"\x00\x7e\x00\x00")]), "NaN or Inf"),
    ("bf16 Inf", update_blob([_rec(vcodec=3, values=b"\x80\x7f\x00\x00")]), "NaN or Inf"),
    ("bf16 NaN", update_blob([_rec(vcodec=3, values=b"\xc0\x7f\x00\x00")]), "NaN or Inf"),
    ("int8 scale NaN", update_blob([_rec(vcodec=4, values=b"\x01\x02", scale=float("nan"))]), "scale"),
    ("int8 scale Inf", update_blob([_rec(vcodec=4, values=b"\x01\x02", scale=float("inf"))]), "scale"),
    ("int8 scale negative", update_blob([_rec(vcodec=4, values=b"\x01\x02", scale=-1.0)]), "scale"),
    ("int8 overflow to Inf", update_blob([_rec(vcodec=4, values=b"\x7f\x02", scale=3e38)]), "NaN or Inf"),
    ("int8 -128", update_blob([_rec(vcodec=4, values=b"\x80\x02", scale=1.0)]), "-128"),
    ("fp32 with a scale", update_blob([_rec(scale=2.0)]), "scale"),
    ("info NaN", update_blob([_rec()], info=[(b"acc", float("nan"))]), "not finite"),
    # wrong version, magic, flags, codecs
    ("version 2", update_blob([_rec()], version=2), "version"),
    ("version 0", update_blob([_rec()], version=0), "version"),
    ("magic", update_blob([_rec()], magic=b"FLSV"), "magic"),
    ("unknown flag", update_blob([_rec()], flags=2), "flags"),
    ("value codec 0", update_blob([_rec(vcodec=0)]), "value codec"),
    ("value codec 255", update_blob([_rec(vcodec=255)]), "value codec"),
    ("position method 4", update_blob([_rec(method=4)]), "position method"),
    ("k with a bitmask", update_blob([_rec(method=1, k=3, positions=bitmask([2, 7], 10))]), "rice parameter"),
    # header fields and names
    ("empty federation", update_blob([_rec()], federation=b""), "federation"),
    ("federation with a slash", update_blob([_rec()], federation=b"a/b"), "federation"),
    ("non-ASCII sender", update_blob([_rec()], sender=b"c\xc3\xa9"), "ASCII"),
    ("num_samples 0", update_blob([_rec()], num_samples=0), "num_samples"),
    ("duplicate tensor", update_blob([_rec(), _rec()]), "twice"),
    ("empty name", update_blob([_rec(name=b"")]), "name"),
    ("name not UTF-8", update_blob([_rec(name=b"\xff\xfe")]), "UTF-8"),
    ("duplicate info key", update_blob([_rec()], info=[(b"a", 1.0), (b"a", 2.0)]), "repeated"),
    # zstd
    ("zstd flag on a raw payload", update_blob([_rec()], flags=1), "zstd|limit"),
    (
        "zstd size mismatch",
        update_blob([], flags=1, payload=_zstd_payload(_rec(), len(_rec()) + 1)),
        "declares",
    ),
    (
        "zstd without content size",
        update_blob([], flags=1, payload=_zstd_payload(_rec(), write_size=False)),
        "declares",
    ),
    (
        "zstd trailing data",
        update_blob([_rec()], ntensors=1, flags=1, payload=_zstd_payload(_rec()) + b"\x00"),
        "zstd",
    ),
    (
        "zstd frame magic",
        update_blob(
            [_rec()], flags=1, payload=_zstd_payload(_rec())[:4] + b"\0\0\0\0" + _zstd_payload(_rec())[8:]
        ),
        "zstd",
    ),
    ("zstd frame cut short", update_blob([_rec()], flags=1, payload=_zstd_payload(_rec())[:-5]), "zstd"),
]


@pytest.mark.parametrize("name, blob, reason", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_hostile_update_blobs(name: str, blob: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_update(blob)


def test_zstd_bomb_is_bounded_by_the_limit() -> None:
    from protocol import WireLimits

    raw = _rec(shape=(2_000_000,), count=0, positions=rice_reference([], 0), values=b"") + b"\x00" * 4_000_000
    blob = update_blob([], flags=1, payload=_zstd_payload(raw))
    assert len(blob) < 1000  # a 4 MB payload in a few hundred bytes
    with pytest.raises(WireError, match="limit"):
        decode_update(blob, WireLimits(max_blob_bytes=1_000_000))


def _valid_payloads() -> dict[str, tuple[bytes, Callable[[bytes], object]]]:
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(5000, 400, replace=False))
    update = Update(
        {
            "a": TensorDelta((50, 100), rng.standard_normal(400).astype(np.float32), idx),
            "b": TensorDelta((64,), rng.standard_normal(32).astype(np.float32), np.arange(0, 64, 2)[:32]),
            "c": TensorDelta((3, 3), rng.standard_normal(9).astype(np.float32)),
        },
        12,
        {"acc": 0.7},
    )
    header = UpdateHeader("fed", 2, "c1", "ab" * 32)
    state = encode_state({"w": rng.standard_normal((4, 5)).astype(np.float32), "b": np.zeros(5, np.float32)})
    return {
        "update": (encode_update(update, header), decode_update),
        "update-int8-zstd": (encode_update(update, header, UpdateOptions("int8", True)), decode_update),
        "state": (state, decode_state),
        "chunk": (chunk_blob(state, Kind.MODEL_CHUNK, "fed", "coord", 2, 200)[1], decode_envelope),
        "plan": (
            encode_message(
                Plan(2, ("c1",), 1e9, "flayer", {}, {"name": "cnn"}, "ab" * 32, 1, 10), "fed", "coord"
            ),
            decode_message,
        ),
        "ack": (encode_message(Ack(2, "c1", "ab" * 32, "accepted"), "fed", "coord"), decode_message),
    }


@pytest.mark.parametrize("kind", list(_valid_payloads()))
def test_truncation_at_every_byte(kind: str) -> None:
    payload, decode = _valid_payloads()[kind]
    decode(payload)
    for n in range(len(payload)):
        with pytest.raises(WireError):
            decode(payload[:n])


ENVELOPE_BODY = b"some chunk body"
ENVELOPE_CASES: list[tuple[str, bytes, str]] = [
    ("magic", envelope(ENVELOPE_BODY, magic=b"MQTT"), "magic"),
    ("version 3", envelope(ENVELOPE_BODY, version=3), "version"),
    ("version 1 (unsigned, an earlier release)", envelope(ENVELOPE_BODY, version=1), "needs envelope format version 2"),
    ("kind 0", envelope(ENVELOPE_BODY, kind=0, codec=1), "kind"),
    ("kind 8", envelope(ENVELOPE_BODY, kind=8, codec=1), "kind"),
    ("secagg with the json codec", envelope(ENVELOPE_BODY, kind=7, codec=1), "codec 1 is not the codec of secagg"),
    ("codec of another kind", envelope(ENVELOPE_BODY, kind=1, codec=3), "codec"),
    ("flags", envelope(ENVELOPE_BODY, flags=1), "flags"),
    ("count 0", envelope(ENVELOPE_BODY, count=0), "chunk"),
    ("index == count", envelope(ENVELOPE_BODY, index=3, count=3, total=100), "chunk"),
    ("count 2**32-1", envelope(ENVELOPE_BODY, count=2**32 - 1, total=100), "limit"),
    ("total 2**64-1", envelope(ENVELOPE_BODY, count=2, total=2**64 - 1), "limit"),
    ("body length 2**32-1", envelope(ENVELOPE_BODY, body_len=2**32 - 1), "body length"),
    ("body length short", envelope(ENVELOPE_BODY, body_len=3), "body length"),
    ("body larger than the blob", envelope(ENVELOPE_BODY, count=2, total=4), "inconsistent"),
    ("single chunk size mismatch", envelope(ENVELOPE_BODY, total=100), "inconsistent"),
    ("crc mismatch", envelope(ENVELOPE_BODY, crc=12345), "checksum"),
    ("digest mismatch", envelope(ENVELOPE_BODY, digest=hashlib.sha256(b"other").digest()), "digest"),
    ("bad sender", envelope(ENVELOPE_BODY, sender=b"c+1"), "sender"),
    ("empty federation", envelope(ENVELOPE_BODY, federation=b""), "federation"),
    ("json in two chunks", envelope(b"{}", kind=3, count=2, total=4), "single-chunk"),
    ("json over the limit", envelope(b"{}", kind=3, total=10**6, count=1), "limit"),
]


@pytest.mark.parametrize("name, payload, reason", ENVELOPE_CASES, ids=[c[0] for c in ENVELOPE_CASES])
def test_hostile_envelopes(name: str, payload: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_envelope(payload)


def test_chunk_digest_mismatch_after_reassembly() -> None:
    """Chunks each pass their crc32, but one belongs to another blob: the sha256 catches it."""
    a, b = b"A" * 600, b"A" * 300 + b"B" * 300
    ca = chunk_blob(a, Kind.MODEL_CHUNK, "fed", "coord", 1, 400)
    cb = chunk_blob(b, Kind.MODEL_CHUNK, "fed", "coord", 1, 400, digest=hashlib.sha256(a).hexdigest())
    r = Reassembler()
    r.add(decode_envelope(ca[0]))
    for p in cb[1:]:
        r.add(decode_envelope(p))
    with pytest.raises(WireError, match="digest"):
        r.blob()
