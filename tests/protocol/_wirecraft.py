"""Build wire payloads field by field, independently of the encoders, for hand-made test corpora.

The layouts here are written from the documented formats (docs/reference/wire.md and the module
docstrings), so a test that decodes these bytes also checks the encoders against the documentation.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence


def rice_reference(gaps_minus_one: Sequence[int], k: int) -> bytes:
    """Rice stream (u32 unary length, unary bits, k-bit remainders), one bit at a time."""
    unary, rem = [], []
    for v in gaps_minus_one:
        q, r = v >> k, v & ((1 << k) - 1)
        unary += [0] * q + [1]
        rem += [(r >> (k - 1 - b)) & 1 for b in range(k)]

    def pack(bits: list[int]) -> bytes:
        bits = bits + [0] * (-len(bits) % 8)
        return bytes(int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, len(bits), 8))

    u = pack(unary)
    return struct.pack("<I", len(u)) + u + pack(rem)


def bitmask(positions: Sequence[int], numel: int) -> bytes:
    bits = [0] * numel
    for p in positions:
        bits[p] = 1
    bits += [0] * (-numel % 8)
    return bytes(int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, len(bits), 8))


def tensor_record(
    name: bytes,
    shape: Sequence[int],
    count: int,
    positions: bytes,
    values: bytes,
    *,
    vcodec: int = 1,
    method: int = 2,
    k: int = 0,
    scale: float = 0.0,
    name_len: int | None = None,
    ndim: int | None = None,
    pos_len: int | None = None,
    val_len: int | None = None,
) -> bytes:
    return (
        struct.pack("<H", len(name) if name_len is None else name_len)
        + name
        + struct.pack("<BBBB", len(shape) if ndim is None else ndim, vcodec, method, k)
        + struct.pack(f"<{len(shape)}I", *shape)
        + struct.pack(
            "<IIIf",
            count,
            len(positions) if pos_len is None else pos_len,
            len(values) if val_len is None else val_len,
            scale,
        )
        + positions
        + values
    )


def update_blob(
    records: Sequence[bytes],
    *,
    magic: bytes = b"FLSU",
    version: int = 1,
    flags: int = 0,
    federation: bytes = b"fed",
    sender: bytes = b"c1",
    round_: int = 1,
    num_samples: int = 10,
    digest: bytes = b"\x11" * 32,
    ntensors: int | None = None,
    info: Sequence[tuple[bytes, float]] = ((b"acc", 0.5),),
    ninfo: int | None = None,
    payload: bytes | None = None,
) -> bytes:
    head = (
        struct.pack(
            "<4sBBBBII32sIH",
            magic,
            version,
            flags,
            len(federation),
            len(sender),
            round_,
            num_samples,
            digest,
            len(records) if ntensors is None else ntensors,
            len(info) if ninfo is None else ninfo,
        )
        + federation
        + sender
    )
    for key, value in info:
        head += struct.pack("<B", len(key)) + key + struct.pack("<d", value)
    return head + (b"".join(records) if payload is None else payload)


def envelope(
    body: bytes,
    *,
    kind: int = 2,
    codec: int | None = None,
    version: int = 2,
    flags: int = 0,
    round_: int = 1,
    index: int = 0,
    count: int = 1,
    total: int | None = None,
    body_len: int | None = None,
    crc: int | None = None,
    digest: bytes | None = None,
    federation: bytes = b"fed",
    sender: bytes = b"c1",
    magic: bytes = b"FLEW",
    signature: bytes = bytes(64),
) -> bytes:
    codec = {1: 2, 2: 3}.get(kind, 1) if codec is None else codec
    return (
        struct.pack(
            "<4sBBBBIIIQII32sBB",
            magic,
            version,
            kind,
            codec,
            flags,
            round_,
            index,
            count,
            len(body) if total is None else total,
            len(body) if body_len is None else body_len,
            zlib.crc32(body) if crc is None else crc,
            hashlib.sha256(body).digest() if digest is None else digest,
            len(federation),
            len(sender),
        )
        + federation
        + sender
        + signature
        + body
    )
