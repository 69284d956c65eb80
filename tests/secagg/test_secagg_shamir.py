"""Shamir t-of-n sharing (flayer/secagg/shamir.py): t shares rebuild, t-1 determine nothing, refusals."""

from __future__ import annotations

import itertools
import random

import pytest

from flayer.secagg import SeededEntropy
from flayer.secagg.prg import randbelow_from
from flayer.secagg.shamir import (
    PRIME,
    SHARE_LEN,
    combine,
    decode_share,
    encode_share,
    lagrange_at_zero,
    split,
)

SECRET = bytes(range(32))


@pytest.mark.parametrize(("t", "n"), [(1, 1), (2, 3), (3, 5), (5, 9)])
def test_any_t_shares_rebuild_the_secret(t, n):
    shares = split(SECRET, t, list(range(1, n + 1)))
    for subset in itertools.combinations(sorted(shares), t):
        assert combine({x: shares[x] for x in subset}, t) == SECRET
    assert combine(shares, t) == SECRET  # more than t: the t smallest x are used


def test_fewer_than_t_shares_are_refused():
    shares = split(SECRET, 3, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="at least 3"):
        combine({1: shares[1], 2: shares[2]}, 3)


def test_t_minus_1_shares_are_consistent_with_every_secret():
    """For any candidate secret S' one more (fabricated) share makes t shares that interpolate to S'."""
    t, rnd = 4, random.Random(7)
    shares = split(SECRET, t, [3, 5, 8, 13, 21])
    known = {x: shares[x] for x in (3, 5, 8)}  # t - 1 genuine shares
    basis = lagrange_at_zero([3, 5, 8, 21])
    for _ in range(20):
        target = rnd.randbytes(32)
        partial = sum(known[x] * basis[x] for x in known) % PRIME
        y = (int.from_bytes(target, "big") - partial) * pow(basis[21], -1, PRIME) % PRIME
        assert combine({**known, 21: y}, t) == target
    assert combine({**known, 21: shares[21]}, t) == SECRET


def test_a_seeded_draw_is_reproducible_and_a_fresh_one_is_not():
    a = split(SECRET, 3, [1, 2, 3], randbelow_from(SeededEntropy(bytes(32))))
    b = split(SECRET, 3, [1, 2, 3], randbelow_from(SeededEntropy(bytes(32))))
    assert a == b
    assert split(SECRET, 3, [1, 2, 3]) != split(SECRET, 3, [1, 2, 3])  # secrets.randbelow


@pytest.mark.parametrize("xs", [[0, 1, 2], [1, 1, 2], [1, 2, 70_000], [1, -2, 3]])
def test_bad_x_coordinates_are_refused(xs):
    with pytest.raises(ValueError, match="x"):
        split(SECRET, 2, xs)


def test_combine_refuses_a_zero_x_and_a_y_outside_the_field():
    shares = split(SECRET, 2, [1, 2])
    with pytest.raises(ValueError, match="x"):
        combine({0: shares[1], 2: shares[2]}, 2)
    with pytest.raises(ValueError, match="y"):
        combine({1: PRIME, 2: shares[2]}, 2)


def test_inconsistent_shares_are_refused():
    shares = split(SECRET, 2, [1, 2])
    shares[2] = (shares[2] - 2**256) % PRIME  # L_2(0) = -1: the secret moves up by 2^256, past 32 bytes
    with pytest.raises(ValueError, match="inconsistent"):
        combine(shares, 2)


def test_split_refuses_bad_secrets_and_thresholds():
    with pytest.raises(ValueError, match="32 bytes"):
        split(b"short", 2, [1, 2])
    with pytest.raises(ValueError, match="threshold"):
        split(SECRET, 3, [1, 2])
    with pytest.raises(ValueError, match="threshold"):
        split(SECRET, 0, [1, 2])
    with pytest.raises(ValueError, match="randbelow"):
        split(SECRET, 2, [1, 2], randbelow=lambda p: p)


def test_share_encoding_round_trips_and_refuses_garbage():
    shares = split(SECRET, 2, [1, 65535])
    for x, y in shares.items():
        raw = encode_share(x, y)
        assert len(raw) == SHARE_LEN and decode_share(raw) == (x, y)
    with pytest.raises(ValueError, match="68 bytes"):
        decode_share(raw[:-1])
    with pytest.raises(ValueError, match="x"):
        decode_share(b"\x00\x00" + raw[2:])
    with pytest.raises(ValueError, match="below p"):
        decode_share(raw[:2] + b"\xff" * (SHARE_LEN - 2))
