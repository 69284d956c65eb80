"""Shamir t-of-n secret sharing of 32-byte secrets over GF(p), p = 2^521 - 1 (Shamir, CACM 1979).

A secret S < 2^256 (32 bytes, big-endian) is the constant term of a random polynomial
``f(X) = S + a_1 X + ... + a_{t-1} X^{t-1}`` over GF(p) with a Mersenne prime p > 2^256; share i is
``(x_i, f(x_i))``. Any t shares give S by Lagrange interpolation at 0; any t-1 shares are consistent
with every secret (for each candidate S' exactly one polynomial of degree < t passes through them and
(0, S')), so they carry no information about S. Used by the secure aggregation of
:mod:`flayer.secagg` for a device's self-mask seed b_u and its mask private key s_u (Bonawitz et al.,
CCS 2017, Sec. 4).

x coordinates are 1..65535 (the protocol uses a device's index in the sorted participants plus 1);
a share is encoded as 2 bytes x (little-endian) and 66 bytes y (big-endian), 68 bytes in all.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "MAX_X",
    "PRIME",
    "SECRET_LEN",
    "SHARE_LEN",
    "combine",
    "decode_share",
    "encode_share",
    "evaluate",
    "lagrange_at_zero",
    "split",
]

PRIME = (1 << 521) - 1  # a Mersenne prime, > 2^256
SECRET_LEN = 32
MAX_X = 0xFFFF
_Y_LEN = (PRIME.bit_length() + 7) // 8  # 66
SHARE_LEN = 2 + _Y_LEN


def _check_xs(xs: Sequence[int]) -> None:
    seen: set[int] = set()
    for x in xs:
        if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= MAX_X:
            raise ValueError(f"share x must be an integer in [1, {MAX_X}], got {x!r}")
        if x in seen:
            raise ValueError(f"duplicate share x {x}")
        seen.add(x)


def _check_threshold(threshold: object, available: int) -> int:
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        raise ValueError(f"threshold must be an integer >= 1, got {threshold!r}")
    if threshold > available:
        raise ValueError(f"threshold {threshold} needs at least {threshold} shares, got {available}")
    return threshold


def split(secret: bytes, threshold: int, xs: Sequence[int],
          randbelow: Callable[[int], int] = secrets.randbelow) -> dict[int, int]:
    """Shares ``{x: f(x)}`` of ``secret`` (32 bytes), any ``threshold`` of which reconstruct it.

    ``randbelow(p)`` draws each of the t-1 random coefficients uniformly from [0, p); pass a seeded
    one for reproducible runs, never in deployment.
    """
    if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_LEN:
        raise ValueError(f"secret must be {SECRET_LEN} bytes, got {type(secret).__name__} "
                         f"of length {len(secret) if hasattr(secret, '__len__') else '?'}")
    _check_xs(xs)
    _check_threshold(threshold, len(xs))
    coefficients = [int.from_bytes(secret, "big")]
    for _ in range(threshold - 1):
        c = randbelow(PRIME)
        if not isinstance(c, int) or not 0 <= c < PRIME:
            raise ValueError(f"randbelow returned {c!r}, outside [0, p)")
        coefficients.append(c)
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


def lagrange_at_zero(xs: Sequence[int]) -> dict[int, int]:
    """The Lagrange basis values ``L_i(0) = prod_{j != i} x_j / (x_j - x_i)`` mod p, keyed by x_i."""
    _check_xs(xs)
    out = {}
    for xi in xs:
        num, den = 1, 1
        for xj in xs:
            if xj != xi:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        out[xi] = num * pow(den, -1, PRIME) % PRIME
    return out


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (the ``threshold`` smallest x are used).

    ValueError with fewer than ``threshold`` shares, an x outside [1, 65535] (0 would be the secret
    itself), a y outside [0, p), or shares that interpolate to a value that is no 32-byte secret.
    """
    xs = sorted(shares)
    _check_xs(xs)
    _check_threshold(threshold, len(xs))
    for x in xs:
        y = shares[x]
        if not isinstance(y, int) or isinstance(y, bool) or not 0 <= y < PRIME:
            raise ValueError(f"share y at x={x} must be an integer in [0, p)")
    used = xs[:threshold]
    basis = lagrange_at_zero(used)
    value = sum(shares[x] * basis[x] for x in used) % PRIME
    if value >= 1 << (8 * SECRET_LEN):
        raise ValueError("the shares are inconsistent: they interpolate to no 32-byte secret")
    return value.to_bytes(SECRET_LEN, "big")


def evaluate(shares: Mapping[int, int], x: int) -> int:
    """The polynomial of degree < len(shares) through ``shares``, evaluated at ``x`` (Lagrange, mod p): the
    value an honest share at ``x`` must hold when ``shares`` are honest."""
    xs = sorted(shares)
    _check_xs(xs)
    total = 0
    for xi in xs:
        num, den = 1, 1
        for xj in xs:
            if xj != xi:
                num = num * (x - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + shares[xi] * num * pow(den, -1, PRIME)) % PRIME
    return total


def encode_share(x: int, y: int) -> bytes:
    """68 bytes: x (u16 little-endian), y (66 bytes big-endian)."""
    _check_xs([x])
    if not isinstance(y, int) or not 0 <= y < PRIME:
        raise ValueError("share y must be an integer in [0, p)")
    return x.to_bytes(2, "little") + y.to_bytes(_Y_LEN, "big")


def decode_share(data: bytes) -> tuple[int, int]:
    """``(x, y)`` from :func:`encode_share`'s 68 bytes; ValueError naming the bad field."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != SHARE_LEN:
        raise ValueError(f"share must be {SHARE_LEN} bytes, got {len(data) if hasattr(data, '__len__') else '?'}")
    x = int.from_bytes(data[:2], "little")
    if not 1 <= x <= MAX_X:
        raise ValueError(f"share x must be in [1, {MAX_X}], got {x}")
    y = int.from_bytes(data[2:], "big")
    if y >= PRIME:
        raise ValueError("share y must be below p")
    return x, y
