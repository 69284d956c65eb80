"""The fixed-point ring (flayer/secagg/ring.py): the overflow bound, the error bound, the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flayer.secagg import RingSpec, decode_sum, encode


def ring_sum(vectors: list[np.ndarray]) -> np.ndarray:
    total = np.zeros(vectors[0].shape, dtype=np.uint32)
    for v in vectors:
        total += v  # wraps mod 2^32, as the masked sum does
    return total


@pytest.mark.parametrize(("clip", "summands", "bits"), [(1.0, 1, 32), (1.0, 30, 32), (0.37, 1000, 32),
                                                        (5.0, 100_000, 32), (1.0, 7, 16), (3.3, 2, 8)])
def test_for_summands_meets_the_overflow_bound_and_is_the_largest_power_of_two(clip, summands, bits):
    spec = RingSpec.for_summands(clip, summands, bits)
    limit = 2 ** (bits - 1) - 1
    assert summands * math.ceil(clip * spec.scale) <= limit  # |sum| <= m * C * s < 2^(bits-1)
    assert summands * math.ceil(clip * spec.scale * 2) > limit  # no finer power of two fits
    assert math.log2(spec.scale).is_integer()


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize(("summands", "bits"), [(30, 32), (1000, 32), (5, 12)])
def test_the_sum_at_max_summands_of_plus_and_minus_clip_does_not_wrap(stochastic, summands, bits):
    spec = RingSpec.for_summands(2.5, summands, bits)
    rng = np.random.default_rng(3) if stochastic else None
    edge = np.array([2.5, -2.5, 1e9, -1e9, 2.4999])  # 1e9 and -1e9 clip to +-C
    total = decode_sum(ring_sum([encode(edge, spec, rng) for _ in range(summands)]), spec, summands)
    expected = summands * np.array([2.5, -2.5, 2.5, -2.5, 2.4999])
    assert np.all(np.abs(total - expected) <= summands / spec.scale)  # right sign and size: no wrap
    assert spec.max_summands * spec.q_max <= 2 ** (bits - 1) - 1


def test_an_explicit_scale_past_the_bound_is_refused():
    spec = RingSpec.for_summands(1.0, 10)
    with pytest.raises(ValueError, match="overflows"):
        RingSpec(1.0, 32, spec.scale * 2, max_summands=10)
    RingSpec(1.0, 32, spec.scale, max_summands=10)  # the largest one is accepted
    with pytest.raises(ValueError, match="max_summands"):
        RingSpec.for_summands(1.0, 2**7, bits=8)


@pytest.mark.parametrize("stochastic", [True, False])
def test_decode_error_is_within_count_over_scale(stochastic):
    rng = np.random.default_rng(11)
    count = 25
    spec = RingSpec.for_summands(1.0, count, bits=16)  # a coarse ring, so the error is visible
    values = [rng.uniform(-1.4, 1.4, 2000) for _ in range(count)]
    total = decode_sum(ring_sum([encode(v, spec, rng if stochastic else None) for v in values]), spec, count)
    exact = np.sum([np.clip(v, -1.0, 1.0) for v in values], axis=0)
    err = np.abs(total - exact)
    bound = count / spec.scale if stochastic else count / (2 * spec.scale)
    assert err.max() <= bound
    assert err.max() > bound / 100  # the ring is coarse enough that the bound is not vacuous here


def test_one_coordinate_errs_by_less_than_one_over_scale():
    rng = np.random.default_rng(5)
    spec = RingSpec(1.0, 16, scale=10.0, max_summands=1)
    values = rng.uniform(-1, 1, 10_000)
    err = np.abs(decode_sum(encode(values, spec, rng), spec, 1) - values)
    assert err.max() < 1 / spec.scale
    nearest = np.abs(decode_sum(encode(values, spec, None), spec, 1) - values)
    assert nearest.max() <= 0.5 / spec.scale + 1e-12


def test_stochastic_rounding_is_unbiased():
    spec = RingSpec(1.0, 16, scale=4.0, max_summands=1)
    x = np.full(200_000, 0.1)  # 0.4 in units of 1/s: rounds to 0 or 1
    mean = decode_sum(encode(x, spec, np.random.default_rng(1)), spec, 1).mean()
    assert abs(mean - 0.1) < 5 * 0.5 / 4.0 / math.sqrt(x.size)
    assert decode_sum(encode(x, spec, None), spec, 1).mean() == 0.0  # nearest is biased (to 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(bad):
    spec = RingSpec.for_summands(1.0, 3)
    with pytest.raises(ValueError, match="finite"):
        encode(np.array([0.0, bad]), spec, None)


def test_encode_and_decode_refuse_what_they_cannot_handle():
    spec = RingSpec.for_summands(1.0, 3)
    with pytest.raises(ValueError, match="one-dimensional"):
        encode(np.zeros((2, 2)), spec, None)
    with pytest.raises(ValueError, match="count"):
        decode_sum(np.zeros(3, np.uint32), spec, 4)  # more summands than the bound allows
    with pytest.raises(ValueError, match="uint32"):
        decode_sum(np.zeros(3, np.int64), spec, 1)
    garbage = np.array([2**31 - 5], dtype=np.uint32)  # no 3 summands of |q| <= q_max reach it
    with pytest.raises(ValueError, match="exceeds"):
        decode_sum(garbage, spec, 3)
    for kwargs in ({"clip_range": 0.0}, {"clip_range": math.inf}, {"clip_range": 1.0, "bits": 33},
                   {"clip_range": 1.0, "scale": -1.0}, {"clip_range": 1.0, "max_summands": 0}):
        with pytest.raises(ValueError):
            RingSpec(**kwargs)


def test_negative_values_wrap_to_twos_complement():
    spec = RingSpec(1.0, 32, scale=4.0, max_summands=1)
    assert encode(np.array([-0.25, 0.25]), spec, None).tolist() == [2**32 - 1, 1]
    small = RingSpec(1.0, 8, scale=4.0, max_summands=1)
    assert encode(np.array([-0.25]), small, None).tolist() == [255]
