"""The ring only as wide as the bounded, quantised sum needs (RingSpec.for_bound) and the masked input packed at
that width (flayer/secagg/packing.py): the worst honest sum fits, a wrapped sum is refused, the bytes follow."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flayer.secagg import (
    MaskedInput,
    RingSpec,
    SecAggError,
    SecAggParams,
    decode_message,
    decode_sum,
    encode,
    run_round,
)
from flayer.secagg.packing import pack_values, packed_size, unpack_values
from flayer.secagg.ring import MARGIN_BITS

CASES = [(8.0, 2, 16, 0.0), (8.0, 100, 16, 0.0), (8.0, 1000, 16, 0.0), (0.37, 1000, 12, 0.0), (1.0, 20, 16, 2.7),
         (4.47, 65535, 20, 0.0), (1.0, 1000, 30, 0.0), (1e6, 3, 8, 0.0)]


def _wrapping_sum(vectors: list[np.ndarray], spec: RingSpec) -> np.ndarray:
    total = np.zeros(vectors[0].shape, dtype=np.uint32)
    for v in vectors:
        total += v
    return total & np.uint32(spec.modulus - 1)  # the sum as the ring keeps it: mod 2^bits


@pytest.mark.parametrize(("value_range", "summands", "value_bits", "headroom"), CASES)
def test_the_worst_honest_sum_fits_and_the_width_is_the_least_that_does_plus_the_margin(
        value_range, summands, value_bits, headroom):
    spec = RingSpec.for_bound(value_range, summands, value_bits, headroom)
    need = summands * spec.q_max  # the largest |sum| of honest inputs: every one at the edge of range + headroom
    if spec.bits < 32:
        assert spec.scale == 2.0 ** math.floor(math.log2(2 ** (value_bits - 1) / value_range))  # the resolution asked
        assert need <= 2 ** (spec.bits - 1 - MARGIN_BITS) - 1 < 2 * need  # one bit less would not hold it
    else:  # too wide for 32 bits at that resolution: the 32-bit ring, coarser
        assert spec.scale < 2 ** (value_bits - 1) / value_range and need <= spec.sum_limit
    edge = value_range + headroom
    rng = np.random.default_rng(0)
    for sign in (1, -1):  # honest encodings reach q_max at most (stochastic rounding of the edge, and past it)
        q = encode(sign * np.linspace(edge * 0.999, edge * 2, 4000), spec, rng).astype(np.int64)
        signed = np.where(q > spec.sum_limit, q - spec.modulus, q)
        assert np.abs(signed).max() <= spec.q_max
    count = min(summands, 2000)
    for worst in (spec.q_max, spec.modulus - spec.q_max):  # every summand at +q_max, or at -q_max
        one = np.full(3, worst, dtype=np.uint32)
        total = decode_sum(_wrapping_sum([one] * count, spec), spec, count)
        sign = 1 if worst == spec.q_max else -1
        assert np.all(total == sign * count * spec.q_max / spec.scale)  # exact, right sign: no wrap
    if summands > 2000:  # the whole cohort's worst sum, by its integer: within the signed reading
        assert summands * spec.q_max <= spec.sum_limit


def test_a_sum_past_the_honest_range_is_refused_and_the_margin_makes_that_most_sums():
    spec = RingSpec.for_bound(8.0, 10, 16)
    honest = spec.max_summands * spec.q_max
    ring = np.arange(spec.modulus, dtype=np.int64)  # every value a sum can take
    signed = np.where(ring > spec.sum_limit, ring - spec.modulus, ring)
    assert np.mean(np.abs(signed) > honest) >= 0.5  # a wrapped sum lands outside the honest range at least half the time
    with pytest.raises(ValueError, match="exceeds what 10 summands"):
        decode_sum(np.array([honest + 1], dtype=np.uint32), spec, 10)
    with pytest.raises(ValueError, match="exceeds what 10 summands"):
        decode_sum(np.array([spec.modulus - honest - 1], dtype=np.uint32), spec, 10)  # -(honest + 1)
    assert decode_sum(np.array([honest], dtype=np.uint32), spec, 10)[0] == honest / spec.scale
    with pytest.raises(ValueError, match="count"):  # more summands than the ring was sized for could wrap
        decode_sum(np.zeros(1, dtype=np.uint32), spec, 11)


def test_a_ring_narrower_than_its_cohort_needs_is_refused():
    spec = RingSpec.for_bound(8.0, 100, 16)
    for bits in range(2, spec.bits - MARGIN_BITS):  # without the margin it fits; one bit less does not
        with pytest.raises(ValueError, match="overflows|cannot fit"):
            RingSpec(spec.clip_range, bits, spec.scale, 100)
    RingSpec(spec.clip_range, spec.bits - MARGIN_BITS, spec.scale, 100)
    with pytest.raises(ValueError, match="overflows"):
        RingSpec(spec.clip_range, spec.bits, spec.scale * 2 ** (MARGIN_BITS + 1), 100)  # a finer scale in it
    for bad in ({"value_bits": 7}, {"value_bits": 31}, {"value_bits": True}, {"headroom": -1.0},
                {"headroom": math.inf}, {"value_range": 0.0}, {"max_summands": 0}):
        kwargs = {"value_range": 8.0, "max_summands": 10, "value_bits": 16, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            RingSpec.for_bound(**kwargs)


@pytest.mark.parametrize("bits", [2, 3, 7, 8, 13, 16, 17, 24, 25, 31, 32])
@pytest.mark.parametrize("count", [1, 7, 8, 9, 1001])
def test_packing_round_trips_at_every_width_and_refuses_a_second_encoding(bits, count):
    rng = np.random.default_rng(bits * 1000 + count)
    values = rng.integers(0, 2**bits, count, dtype=np.uint64).astype(np.uint32)
    values[0] = 2**bits - 1
    raw = pack_values(values, bits)
    assert len(raw) == packed_size(count, bits) == math.ceil(count * bits / 8)
    assert np.array_equal(unpack_values(raw, count, bits), values)
    stream = int.from_bytes(raw, "little")  # value i at bits [i * bits, (i + 1) * bits), least significant first
    assert all((stream >> (i * bits)) & (2**bits - 1) == int(values[i]) for i in range(min(count, 40)))
    spare = len(raw) * 8 - count * bits
    if spare:
        with pytest.raises(ValueError, match="padding"):
            unpack_values(raw[:-1] + bytes([raw[-1] | 0x80]), count, bits)
    with pytest.raises(ValueError, match="bytes are not"):
        unpack_values(raw + b"\0", count, bits)
    if bits < 32:
        with pytest.raises(ValueError, match="does not fit"):
            pack_values(np.array([2**bits], dtype=np.uint32), bits)


def test_a_round_in_a_narrow_ring_unmasks_the_worst_honest_sum_and_sends_its_width():
    ids = tuple(f"dev-{i:02d}" for i in range(12))
    spec = RingSpec.for_bound(8.0, len(ids), 16)
    assert spec.bits == 1 + (12 * 2**15).bit_length() + MARGIN_BITS == 21
    params = SecAggParams.for_round("fed-test", 1, ids, 1000, spec, b"g" * 32, 0.1)
    edge = np.full(1000, 8.0)
    edge[::2] = -8.0
    vectors = {d: encode(edge, spec, None) for d in ids}
    out = run_round(params, vectors, drop_after={"dev-03": "after_shares"}, seed=b"narrow")
    assert out.abandoned_reason is None and out.sum is not None
    assert np.all(out.sum == 11 * edge)  # 11 survivors, every value at the range's edge: exact
    masked = decode_message(MaskedInput(1, "dev-00", vectors["dev-00"], 21).to_bytes())
    assert isinstance(masked, MaskedInput) and masked.bits == 21 and np.array_equal(masked.vector, vectors["dev-00"])
    assert len(masked.to_bytes()) == 10 + 7 + 1 + 4 + packed_size(1000, 21)  # 2,625 bytes, not 4,000
    with pytest.raises(SecAggError, match="outside Z_2"):
        MaskedInput(1, "dev-00", np.full(4, 2**21, dtype=np.uint32), 21)
