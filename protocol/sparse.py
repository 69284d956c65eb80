"""Position codecs for sparse deltas: which flat positions of a tensor a client sends.

Four methods; the encoder takes whichever gives the fewest bytes for each tensor:

``DENSE`` (0)
    Every position is sent (count == numel): no position bytes at all.
``BITMASK`` (1)
    ``ceil(numel / 8)`` bytes, bit ``j`` (MSB first) set when position ``j`` is sent; the padding
    bits of the last byte are zero.
``RICE`` (2)
    Golomb-Rice code of the gaps between sent positions (first gap from -1, every gap >= 1), with
    parameter ``k``: gap - 1 = q * 2**k + r. Two streams: ``u32 unary_len``, then ``unary_len``
    bytes holding, per gap, ``q`` zero bits then a one bit; then the ``r`` parts, ``k`` bits each,
    MSB first, packed back to back. Both streams are zero-padded to a byte.
``RICE_COMPLEMENT`` (3)
    The same code over the positions that are *not* sent (dense-ish masks, density > 1/2).

The information limit of a set of ``m`` positions among ``n`` is about ``n * H(m/n)`` bits
(binary entropy). For geometric gaps the best Rice parameter is near ``log2(ln 2 / p)``; the encoder
tries that value and its two neighbours and keeps the cheapest, which lands within ~1-3% of
``n * H(p)`` for every density (the complement handles p > 1/2, the bitmask is exact at p = 1/2).

Everything is vectorised with numpy (cumulative sums, ``packbits``/``unpackbits``, ``flatnonzero``);
there is no per-element Python loop. Decoding checks every length against the tensor size before
unpacking, so no allocation exceeds O(numel) for a numel the caller has already accepted.
"""

from __future__ import annotations

import math
import struct
from enum import IntEnum

import numpy as np

from .errors import WireError

__all__ = ["Method", "encode_positions", "decode_positions", "position_bytes", "rice_cost_bits",
           "best_rice_k", "entropy_bits"]

_U32 = struct.Struct("<I")
MAX_RICE_K = 31


class Method(IntEnum):
    DENSE = 0
    BITMASK = 1
    RICE = 2
    RICE_COMPLEMENT = 3


def entropy_bits(numel: int, count: int) -> float:
    """``numel * H(count / numel)``: the information limit of the positions, in bits."""
    if numel <= 0 or count <= 0 or count >= numel:
        return 0.0
    p = count / numel
    return numel * -(p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))


def _gaps_minus_one(pos: np.ndarray) -> np.ndarray:
    """gap_j - 1 >= 0 for strictly increasing ``pos`` (first gap counted from -1)."""
    v = np.empty(pos.size, dtype=np.int64)
    if pos.size:
        v[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=v[1:])
        v[1:] -= 1
    return v


def rice_cost_bits(v: np.ndarray, k: int) -> int:
    """Bits of the Rice code with parameter ``k`` for values ``v`` (unary + remainder streams)."""
    return int(v.size) * (k + 1) + int(np.sum(v >> k, dtype=np.int64))


def best_rice_k(v: np.ndarray, numel: int) -> tuple[int, int]:
    """(k, bytes) of the cheapest Rice parameter near ``log2(ln 2 / p)``, p = len(v) / numel."""
    m = int(v.size)
    if m == 0:
        return 0, _U32.size
    k0 = max(0, min(MAX_RICE_K, round(math.log2(max(math.log(2) * numel / m, 1.0)))))
    best: tuple[int, int] | None = None
    for k in (k0 - 1, k0, k0 + 1):
        if not 0 <= k <= MAX_RICE_K:
            continue
        unary_bits = rice_cost_bits(v, k) - m * k
        size = _U32.size + (unary_bits + 7) // 8 + (m * k + 7) // 8
        if best is None or size < best[1]:
            best = (k, size)
    assert best is not None
    return best


def _complement(pos: np.ndarray, numel: int) -> np.ndarray:
    mask = np.ones(numel, dtype=bool)
    mask[pos] = False
    return np.flatnonzero(mask)


def position_bytes(pos: np.ndarray | None, numel: int) -> tuple[Method, int, int]:
    """(method, rice k, byte size) of the cheapest encoding of ``pos`` (None = all positions)."""
    m = numel if pos is None else int(pos.size)
    if m == numel:
        return Method.DENSE, 0, 0
    assert pos is not None
    bitmask = (numel + 7) // 8
    if 2 * m <= numel:
        method, k, rice = Method.RICE, *best_rice_k(_gaps_minus_one(pos), numel)
    else:
        comp = _complement(pos, numel)
        method, k, rice = Method.RICE_COMPLEMENT, *best_rice_k(_gaps_minus_one(comp), numel)
    if rice < bitmask:
        return method, k, rice
    return Method.BITMASK, 0, bitmask


# ---- fixed-width bit fields (the Rice remainders) -------------------------------------------------

def _width(k: int) -> int:
    return 8 if k <= 8 else 16 if k <= 16 else 32


def _pack_fixed(r: np.ndarray, k: int) -> bytes:
    """``k`` low bits of each value, MSB first, packed back to back."""
    if k == 0 or r.size == 0:
        return b""
    w = _width(k)
    wide = r.astype(f">u{w // 8}")
    bits = np.unpackbits(wide.view(np.uint8).reshape(r.size, w // 8), axis=1)
    return np.packbits(bits[:, w - k:].reshape(-1)).tobytes()


def _unpack_fixed(buf: memoryview, m: int, k: int) -> np.ndarray:
    if k == 0 or m == 0:
        return np.zeros(m, dtype=np.int64)
    w = _width(k)
    raw = np.frombuffer(buf, dtype=np.uint8)
    nbits = m * k
    if nbits % 8 and raw[-1] & ((1 << (8 - nbits % 8)) - 1):
        raise WireError("rice remainder stream: padding bits are not zero")
    bits = np.zeros((m, w), dtype=np.uint8)
    bits[:, w - k:] = np.unpackbits(raw, count=nbits).reshape(m, k)
    return np.packbits(bits, axis=1).view(f">u{w // 8}").reshape(m).astype(np.int64)


# ---- Rice -----------------------------------------------------------------------------------------

def _rice_encode(pos: np.ndarray, k: int) -> bytes:
    v = _gaps_minus_one(pos)
    if v.size == 0:
        return _U32.pack(0)
    q = v >> k
    ends = np.cumsum(q + 1) - 1  # where each unary code's terminating 1 bit lands
    bits = np.zeros(int(ends[-1]) + 1, dtype=np.uint8)
    bits[ends] = 1
    unary = np.packbits(bits).tobytes()
    return _U32.pack(len(unary)) + unary + _pack_fixed(v & ((1 << k) - 1), k)


def _rice_decode(buf: memoryview, m: int, k: int, numel: int) -> np.ndarray:
    """Positions of a Rice stream holding ``m`` gaps, each position < ``numel``."""
    if len(buf) < _U32.size:
        raise WireError("rice positions: truncated before the unary length")
    (unary_len,) = _U32.unpack(buf[:_U32.size])
    rem_len = (m * k + 7) // 8
    # every valid stream has m + sum(q) unary bits, and sum(q) <= (numel - m) >> k
    max_unary = (m + ((numel - m) >> k) + 7) // 8
    if unary_len > max_unary:
        raise WireError(f"rice positions: unary stream of {unary_len} bytes exceeds the {max_unary} possible")
    if len(buf) != _U32.size + unary_len + rem_len:
        raise WireError(f"rice positions: {len(buf)} bytes, expected {_U32.size + unary_len + rem_len} "
                        f"for {m} gaps with k={k} and a {unary_len}-byte unary stream")
    if m == 0:
        if unary_len:
            raise WireError("rice positions: a unary stream for zero positions")
        return np.zeros(0, dtype=np.int64)
    unary = np.frombuffer(buf[_U32.size:_U32.size + unary_len], dtype=np.uint8)
    ends = np.flatnonzero(np.unpackbits(unary))
    if ends.size != m:
        raise WireError(f"rice positions: {ends.size} codes in the unary stream, declared {m}")
    if (int(ends[-1]) >> 3) != unary_len - 1:
        raise WireError("rice positions: unary stream longer than its codes")
    q = np.diff(ends, prepend=-1) - 1
    r = _unpack_fixed(buf[_U32.size + unary_len:], m, k)
    # the last position is the sum of all gaps minus one: check it before forming any position
    total = (int(np.sum(q, dtype=np.int64)) << k) + int(np.sum(r, dtype=np.int64)) + m
    if total > numel:
        raise WireError(f"rice positions: position {total - 1} out of range [0, {numel})")
    gaps = (q << k) + r + 1
    return np.cumsum(gaps) - 1


# ---- public -------------------------------------------------------------------------------------

def encode_positions(pos: np.ndarray | None, numel: int, method: Method, k: int = 0) -> bytes:
    """Encode strictly increasing int64 ``pos`` (< numel; None = all) with ``method``.

    The caller validates ``pos`` (see :mod:`protocol.update_codec`); :func:`position_bytes` picks
    the method and ``k``.
    """
    if method == Method.DENSE:
        if pos is not None and pos.size != numel:
            raise ValueError("DENSE positions need every position")
        return b""
    assert pos is not None
    if method == Method.BITMASK:
        mask = np.zeros(numel, dtype=bool)
        mask[pos] = True
        return np.packbits(mask).tobytes()
    if method == Method.RICE:
        return _rice_encode(pos, k)
    return _rice_encode(_complement(pos, numel), k)


def decode_positions(buf: memoryview, numel: int, count: int, method: int, k: int) -> np.ndarray | None:
    """Positions (int64, strictly increasing, in [0, numel)) or None for DENSE; WireError otherwise.

    ``numel`` and ``count`` must already be checked against the caller's limits (count <= numel).
    """
    if method == Method.DENSE:
        if count != numel or len(buf):
            raise WireError(f"dense positions: count {count} != numel {numel} or {len(buf)} stray bytes")
        return None
    if method not in (Method.RICE, Method.RICE_COMPLEMENT) and k != 0:
        raise WireError(f"rice parameter {k} given for position method {method}")
    if method == Method.BITMASK:
        if len(buf) != (numel + 7) // 8:
            raise WireError(f"bitmask: {len(buf)} bytes, expected {(numel + 7) // 8} for {numel} positions")
        raw = np.frombuffer(buf, dtype=np.uint8)
        if numel % 8 and raw[-1] & ((1 << (8 - numel % 8)) - 1):
            raise WireError("bitmask: padding bits are not zero")
        pos = np.flatnonzero(np.unpackbits(raw, count=numel)).astype(np.int64)
        if pos.size != count:
            raise WireError(f"bitmask: {pos.size} bits set, declared count {count}")
        return pos
    if method in (Method.RICE, Method.RICE_COMPLEMENT):
        if not 0 <= k <= MAX_RICE_K:
            raise WireError(f"rice parameter {k} out of range [0, {MAX_RICE_K}]")
        if method == Method.RICE:
            return _rice_decode(buf, count, k, numel)
        comp = _rice_decode(buf, numel - count, k, numel)
        return _complement(comp, numel).astype(np.int64)
    raise WireError(f"unknown position method {method}")
