"""Position codecs for sparse deltas: which flat positions of a tensor a client sends.

Five methods; the encoder takes whichever gives the fewest bytes for each tensor:

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
``BITMASK_ZSTD`` (4)
    The BITMASK bytes as one zstd frame that declares its content size (``ceil(numel / 8)``).

The information limit of a set of ``m`` positions among ``n`` *independent* ones is about
``n * H(m/n)`` bits (binary entropy). For such masks the best Rice parameter is near
``log2(ln 2 / p)``; the encoder tries that value and its two neighbours and keeps the cheapest,
which lands within ~1-3% of ``n * H(p)`` at every density (the complement handles p > 1/2, the
bitmask is exact at p = 1/2). Real top-|change| masks are not independent: a dead input feature
leaves a whole column of a linear layer unchanged, so its bitmask repeats row after row, and zstd
(level 1: fast, and as good as higher levels on these masks) codes it in well under ``n * H(p)``.

Everything is vectorised with numpy (cumulative sums, ``packbits``/``unpackbits``, ``flatnonzero``);
there is no per-element Python loop. Decoding checks every length before it unpacks anything:
allocations stay within a small multiple of the bytes received, or (zstd) of ``numel / 8`` for a
numel the caller has already checked against its limits.
"""

from __future__ import annotations

import math
import struct
from enum import IntEnum

import numpy as np
import zstandard

from .errors import WireError

__all__ = [
    "Method",
    "best_rice_k",
    "decode_positions",
    "encode_best",
    "encode_positions",
    "entropy_bits",
    "rice_cost_bits",
]

_U32 = struct.Struct("<I")
MAX_RICE_K = 31
MASK_ZSTD_LEVEL = 1
MIN_ZSTD_BITMASK = 64  # bytes: below this a zstd frame's own overhead rarely pays off


class Method(IntEnum):
    DENSE = 0
    BITMASK = 1
    RICE = 2
    RICE_COMPLEMENT = 3
    BITMASK_ZSTD = 4


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


def encode_best(pos: np.ndarray | None, numel: int, zstd_masks: bool = True) -> tuple[Method, int, bytes]:
    """(method, rice k, bytes) of the smallest encoding of ``pos`` (None = all positions).

    ``zstd_masks``: also try BITMASK_ZSTD (costs a zstd pass over the bitmask).
    """
    m = numel if pos is None else int(pos.size)
    if m == numel:
        return Method.DENSE, 0, b""
    assert pos is not None
    bitmask = (numel + 7) // 8
    if 2 * m <= numel:
        method, k, rice = Method.RICE, *best_rice_k(_gaps_minus_one(pos), numel)
    else:
        comp = _complement(pos, numel)
        method, k, rice = Method.RICE_COMPLEMENT, *best_rice_k(_gaps_minus_one(comp), numel)
    if rice >= bitmask:
        method, k, rice = Method.BITMASK, 0, bitmask
    if zstd_masks and bitmask >= MIN_ZSTD_BITMASK:
        frame = _zstd_bitmask(pos, numel)
        if len(frame) < rice:
            return Method.BITMASK_ZSTD, 0, frame
    return method, k, encode_positions(pos, numel, method, k)


def _bitmask(pos: np.ndarray, numel: int) -> bytes:
    mask = np.zeros(numel, dtype=bool)
    mask[pos] = True
    return np.packbits(mask).tobytes()


def _zstd_bitmask(pos: np.ndarray, numel: int) -> bytes:
    compressor = zstandard.ZstdCompressor(level=MASK_ZSTD_LEVEL, write_content_size=True)
    return compressor.compress(_bitmask(pos, numel))


def _bitmask_decode(buf: memoryview | bytes, numel: int, count: int) -> np.ndarray:
    if len(buf) != (numel + 7) // 8:
        raise WireError(f"bitmask: {len(buf)} bytes, expected {(numel + 7) // 8} for {numel} positions")
    raw = np.frombuffer(buf, dtype=np.uint8)
    if numel % 8 and raw[-1] & ((1 << (8 - numel % 8)) - 1):
        raise WireError("bitmask: padding bits are not zero")
    nonzero = np.flatnonzero(raw)
    if nonzero.size > count:  # every non-zero byte holds at least one position
        raise WireError(f"bitmask: more than {nonzero.size} bits set, declared count {count}")
    if 32 * nonzero.size >= numel:
        # dense enough that count >= numel / 32: unpacking every bit costs O(count) memory
        pos = np.flatnonzero(np.unpackbits(raw, count=numel).view(bool)).astype(np.int64)
    else:  # sparse (or a zstd-inflated run of zeros): unpack only the bytes that hold a set bit
        byte, bit = np.nonzero(np.unpackbits(raw[nonzero]).view(bool).reshape(-1, 8))
        pos = nonzero[byte].astype(np.int64) * 8 + bit
    if pos.size != count:
        raise WireError(f"bitmask: {pos.size} bits set, declared count {count}")
    return pos


def _unzstd_bitmask(buf: memoryview, numel: int) -> bytes:
    size = (numel + 7) // 8
    try:
        declared = zstandard.frame_content_size(buf)
        if declared != size:
            raise WireError(f"zstd bitmask: frame declares {declared} bytes, the bitmask has {size}")
        out = zstandard.ZstdDecompressor().decompress(buf, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise WireError(f"zstd bitmask: bad frame ({exc})") from None
    if len(out) != size:
        raise WireError(f"zstd bitmask: {len(out)} bytes decompressed, expected {size}")
    return out


# ---- fixed-width bit fields (the Rice remainders) -------------------------------------------------
# One vectorised pass per bit plane (k <= 31 passes over all values), never a loop over values.

def _pack_fixed(r: np.ndarray, k: int) -> bytes:
    """``k`` low bits of each value, MSB first, packed back to back."""
    if k == 0 or r.size == 0:
        return b""
    bits = np.empty((r.size, k), dtype=np.uint8)
    for j in range(k):
        bits[:, j] = (r >> (k - 1 - j)) & 1
    return np.packbits(bits.reshape(-1)).tobytes()


def _unpack_fixed(buf: memoryview, m: int, k: int) -> np.ndarray:
    if k == 0 or m == 0:
        return np.zeros(m, dtype=np.int64)
    raw = np.frombuffer(buf, dtype=np.uint8)
    nbits = m * k
    if nbits % 8 and raw[-1] & ((1 << (8 - nbits % 8)) - 1):
        raise WireError("rice remainder stream: padding bits are not zero")
    bits = np.unpackbits(raw, count=nbits).reshape(m, k)
    r = np.zeros(m, dtype=np.int64)
    for j in range(k):
        r <<= 1
        r |= bits[:, j]
    return r


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
    ends = np.flatnonzero(np.unpackbits(unary).view(bool))  # bool: numpy's fast nonzero path
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

    The caller validates ``pos`` (see :mod:`protocol.update_codec`); :func:`encode_best` picks the
    method and ``k``.
    """
    if method == Method.DENSE:
        if pos is not None and pos.size != numel:
            raise ValueError("DENSE positions need every position")
        return b""
    assert pos is not None
    if method == Method.BITMASK:
        return _bitmask(pos, numel)
    if method == Method.BITMASK_ZSTD:
        return _zstd_bitmask(pos, numel)
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
        return _bitmask_decode(buf, numel, count)
    if method == Method.BITMASK_ZSTD:
        return _bitmask_decode(_unzstd_bitmask(buf, numel), numel, count)
    if method in (Method.RICE, Method.RICE_COMPLEMENT):
        if not 0 <= k <= MAX_RICE_K:
            raise WireError(f"rice parameter {k} out of range [0, {MAX_RICE_K}]")
        if method == Method.RICE:
            return _rice_decode(buf, count, k, numel)
        comp = _rice_decode(buf, numel - count, k, numel)
        return _complement(comp, numel).astype(np.int64, copy=False)
    raise WireError(f"unknown position method {method}")
