"""Position codecs: round trips, agreement with a bit-by-bit reference, cost near n*H(p)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zstandard
from _wirecraft import bitmask, rice_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import WireError
from protocol.sparse import (
    MIN_ZSTD_BITMASK,
    Method,
    best_rice_k,
    decode_positions,
    encode_best,
    encode_positions,
    entropy_bits,
)


def _positions(rng: np.random.Generator, numel: int, density: float) -> np.ndarray:
    m = int(round(density * numel))
    return np.sort(rng.choice(numel, size=m, replace=False)).astype(np.int64)


def _structured(rng: np.random.Generator, numel: int, density: float, width: int = 64) -> np.ndarray:
    """A column pattern repeated row after row, a few random flips (like a linear layer's mask
    around dead input features)."""
    cols = rng.random(width) < density
    mask = np.resize(cols, numel) ^ (rng.random(numel) < 0.01)
    return np.flatnonzero(mask).astype(np.int64)


def _others(pos: np.ndarray, numel: int) -> list[tuple[Method, int]]:
    """Every method the encoder considers, each with its best k."""
    if pos.size == numel:
        return [(Method.DENSE, 0)]
    rice_k = best_rice_k(np.diff(pos, prepend=-1) - 1, numel)[0]
    comp = np.setdiff1d(np.arange(numel), pos)
    comp_k = best_rice_k(np.diff(comp, prepend=-1) - 1, numel)[0]
    rivals = [(Method.BITMASK, 0), (Method.RICE, rice_k), (Method.RICE_COMPLEMENT, comp_k)]
    return rivals + ([(Method.BITMASK_ZSTD, 0)] if (numel + 7) // 8 >= MIN_ZSTD_BITMASK else [])


@settings(max_examples=150, deadline=None)
@given(
    numel=st.integers(0, 3000),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    structured=st.booleans(),
)
def test_chosen_method_round_trips(numel: int, density: float, seed: int, structured: bool) -> None:
    rng = np.random.default_rng(seed)
    pos = _structured(rng, numel, density) if structured else _positions(rng, numel, density)
    method, k, data = encode_best(pos, numel)
    assert data == encode_positions(pos, numel, method, k)
    assert len(data) <= min(len(encode_positions(pos, numel, m, best_k)) for m, best_k in _others(pos, numel))
    out = decode_positions(memoryview(data), numel, pos.size, method, k)
    if method == Method.DENSE:
        assert out is None and pos.size == numel
    else:
        assert out is not None and out.dtype == np.int64
        np.testing.assert_array_equal(out, pos)


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 400),
    density=st.floats(0.0, 1.0),
    k=st.integers(0, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_method_and_k_round_trips_and_matches_reference(
    numel: int, density: float, k: int, seed: int
) -> None:
    pos = _positions(np.random.default_rng(seed), numel, density)
    gaps = np.diff(pos, prepend=-1) - 1
    rice = encode_positions(pos, numel, Method.RICE, k)
    assert rice == rice_reference(gaps.tolist(), k)
    np.testing.assert_array_equal(decode_positions(memoryview(rice), numel, pos.size, Method.RICE, k), pos)
    mask = encode_positions(pos, numel, Method.BITMASK)
    assert mask == bitmask(pos.tolist(), numel)
    np.testing.assert_array_equal(decode_positions(memoryview(mask), numel, pos.size, Method.BITMASK, 0), pos)
    comp = encode_positions(pos, numel, Method.RICE_COMPLEMENT, k)
    np.testing.assert_array_equal(
        decode_positions(memoryview(comp), numel, pos.size, Method.RICE_COMPLEMENT, k), pos
    )
    z = encode_positions(pos, numel, Method.BITMASK_ZSTD)
    assert zstandard.ZstdDecompressor().decompress(z) == mask
    np.testing.assert_array_equal(
        decode_positions(memoryview(z), numel, pos.size, Method.BITMASK_ZSTD, 0), pos
    )


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
def test_cost_is_within_5_percent_of_the_entropy(density: float) -> None:
    numel = 300_000
    pos = _positions(np.random.default_rng(7), numel, density)
    method, k, data = encode_best(pos, numel)
    bound = entropy_bits(numel, pos.size)
    assert 8 * len(data) <= 1.05 * bound + 64, (method, k, 8 * len(data) / bound)
    # and the bitmask wins exactly where it should
    assert (method == Method.BITMASK) == (abs(density - 0.5) < 0.05)


def test_structured_masks_go_below_the_independent_limit() -> None:
    pos = _structured(np.random.default_rng(2), 512 * 1024, 0.75, width=1024)
    method, _, data = encode_best(pos, 512 * 1024)
    assert method == Method.BITMASK_ZSTD
    assert 8 * len(data) < 0.5 * entropy_bits(512 * 1024, pos.size)
    assert encode_best(pos, 512 * 1024, zstd_masks=False)[0] == Method.RICE_COMPLEMENT


def test_rice_parameter_tracks_density() -> None:
    rng = np.random.default_rng(3)
    ks = []
    for density in (0.005, 0.01, 0.1, 0.2):
        pos = _positions(rng, 200_000, density)
        ks.append(best_rice_k(np.diff(pos, prepend=-1) - 1, 200_000)[0])
    assert ks == sorted(ks, reverse=True) and ks[0] >= 6 and ks[-1] <= 2


def test_empty_and_full_sets() -> None:
    assert encode_best(None, 10) == (Method.DENSE, 0, b"")
    assert encode_best(np.arange(10), 10)[0] == Method.DENSE
    method, k, data = encode_best(np.zeros(0, np.int64), 1000)
    assert decode_positions(memoryview(data), 1000, 0, method, k).size == 0  # type: ignore[union-attr]
    assert decode_positions(memoryview(b""), 0, 0, Method.BITMASK, 0).size == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "case",
    [
        # (stream builder, numel, count, method, k, what the reason mentions)
        (lambda: rice_reference([3, 4], 1), 10, 3, Method.RICE, 1, "codes"),  # fewer codes than declared
        (lambda: rice_reference([3, 4, 0], 1), 10, 2, Method.RICE, 1, "codes"),  # more codes than declared
        (lambda: rice_reference([5, 5], 0), 10, 2, Method.RICE, 0, "out of range"),  # last position 11 >= 10
        (lambda: rice_reference([0, 9], 2), 10, 2, Method.RICE, 2, "out of range"),  # positions 0, 10
        (lambda: rice_reference([2**20], 3), 10, 1, Method.RICE, 3, "exceeds"),  # unary longer than possible
        (lambda: rice_reference([1], 40), 10, 1, Method.RICE, 40, "rice parameter"),
        (lambda: rice_reference([1, 2], 1)[:-1], 10, 2, Method.RICE, 1, "bytes"),
        (lambda: rice_reference([1, 2], 1) + b"\x00", 10, 2, Method.RICE, 1, "bytes"),
        (lambda: b"\x01\x00", 10, 1, Method.RICE, 0, "truncated"),
        (lambda: bitmask([1, 2], 10), 10, 3, Method.BITMASK, 0, "declared"),
        (lambda: bitmask([1, 2], 10)[:-1], 10, 2, Method.BITMASK, 0, "bytes"),
        (lambda: bytes([0b01100000, 0b00100000]), 10, 3, Method.BITMASK, 0, "padding"),
        (lambda: b"\x00", 10, 10, Method.DENSE, 0, "stray"),
        (lambda: b"", 10, 9, Method.DENSE, 0, "count"),
        (lambda: b"", 10, 9, 7, 0, "unknown"),
        (lambda: b"", 10, 9, 5, 0, "unknown"),
        (lambda: bitmask([1], 10), 10, 1, Method.BITMASK, 3, "rice parameter"),
    ],
)
def test_bad_position_streams_raise_wire_error(case: Any) -> None:
    build, numel, count, method, k, reason = case
    data = build()
    with pytest.raises(WireError, match=reason):
        decode_positions(memoryview(data), numel, count, method, k)


def _zstd(raw: bytes, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(raw)


@pytest.mark.parametrize(
    "frame, reason",
    [
        (_zstd(bitmask([1, 2], 100)), "declared"),  # count 3 declared below
        (_zstd(bitmask([1, 2, 3], 100)[:-1]), "frame declares"),
        (_zstd(bitmask([1, 2, 3], 100) + b"\x00"), "frame declares"),
        (_zstd(bitmask([1, 2, 3], 100), content_size=False), "frame declares"),
        (_zstd(bitmask([1, 2, 3], 100)) + b"\x00", "bad frame"),
        (b"\x28\xb5\x2f\xfd" + b"\xff" * 12, "zstd bitmask"),
        (b"", "bad frame"),
        (_zstd(bitmask([1, 2, 3], 100)[:-1] + b"\x01"), "padding"),
        (_zstd(b"\x00" * 10**6), "frame declares"),  # a bomb: far more than 13 bytes
    ],
)
def test_bad_zstd_bitmasks(frame: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_positions(memoryview(frame), 100, 3, Method.BITMASK_ZSTD, 0)


def test_rice_remainder_padding_must_be_zero() -> None:
    data = bytearray(rice_reference([1, 2, 3], 3))  # 9 remainder bits -> 7 padding bits
    data[-1] |= 0x01
    with pytest.raises(WireError, match="padding"):
        decode_positions(memoryview(bytes(data)), 100, 3, Method.RICE, 3)
