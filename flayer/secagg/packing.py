"""Ring elements of ``bits`` bits each, packed back to back on the wire (the masked input's vector).

A masked input lives in Z_{2^bits} (:class:`~flayer.secagg.ring.RingSpec`: the ring is only as wide as the
round's bounded, quantised sum needs), so it travels at ``bits`` bits a value, not the 32 of its ``uint32``
array. The layout is one little-endian bit stream: value i occupies bits ``[i * bits, (i + 1) * bits)``,
least significant bit first, and the stream is zero-padded to whole bytes -- ``ceil(n * bits / 8)`` bytes.
At 32 bits it is exactly the array's little-endian bytes.

Both directions work on groups of 8 values, which fill exactly ``bits`` bytes (four 64-bit words at most),
so the cost is a few vectorised passes over the array.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack_values", "packed_size", "unpack_values"]

_GROUP = 8  # values per group: 8 x bits bits = bits bytes


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` values at ``bits`` bits each."""
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 32:
        raise ValueError(f"bits must be an integer in [1, 32], got {bits!r}")


def pack_values(values: np.ndarray, bits: int) -> bytes:
    """The bit stream of ``values`` (uint32, each below ``2^bits``; ValueError otherwise)."""
    _check_bits(bits)
    if not isinstance(values, np.ndarray) or values.dtype != np.uint32 or values.ndim != 1:
        raise ValueError("values must be a one-dimensional uint32 array")
    if bits < 32 and values.size and int(values.max()) >> bits:
        raise ValueError(f"values hold a number that does not fit in {bits} bits")
    if bits == 32:
        return values.astype("<u4", copy=False).tobytes()
    n = values.size
    groups = -(-n // _GROUP)
    flat = np.zeros(groups * _GROUP, dtype=np.uint64)
    flat[:n] = values
    x = flat.reshape(groups, _GROUP)
    words = np.zeros((groups, 4), dtype=np.uint64)
    for j in range(_GROUP):
        word, shift = divmod(j * bits, 64)
        words[:, word] |= x[:, j] << np.uint64(shift)
        if shift + bits > 64:
            words[:, word + 1] |= x[:, j] >> np.uint64(64 - shift)
    raw = words.astype("<u8", copy=False).view(np.uint8).reshape(groups, 32)[:, :bits]
    return raw.tobytes()[:packed_size(n, bits)]


def unpack_values(raw: bytes, count: int, bits: int) -> np.ndarray:
    """``count`` values from their bit stream (uint32); ValueError if ``raw`` is not exactly
    ``packed_size(count, bits)`` bytes or its padding bits are not zero (one value, one encoding)."""
    _check_bits(bits)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    size = packed_size(count, bits)
    if len(raw) != size:
        raise ValueError(f"{len(raw)} bytes are not {count} values of {bits} bits ({size} bytes)")
    spare = size * 8 - count * bits
    if spare and raw[-1] >> (8 - spare):
        raise ValueError("the padding bits after the last value are not zero")
    if bits == 32:
        return np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    groups = -(-count // _GROUP)
    buf = np.zeros((groups, 32), dtype=np.uint8)
    flat = np.zeros(groups * bits, dtype=np.uint8)
    flat[:size] = np.frombuffer(raw, dtype=np.uint8)
    buf[:, :bits] = flat.reshape(groups, bits)
    words = buf.view("<u8")
    out = np.empty((groups, _GROUP), dtype=np.uint64)
    mask = np.uint64((1 << bits) - 1)
    for j in range(_GROUP):
        word, shift = divmod(j * bits, 64)
        value = words[:, word] >> np.uint64(shift)
        if shift + bits > 64:
            value |= words[:, word + 1] << np.uint64(64 - shift)
        out[:, j] = value & mask
    return out.reshape(-1)[:count].astype(np.uint32)
