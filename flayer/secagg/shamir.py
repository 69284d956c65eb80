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
    "evaluate_many",
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


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """The inverses mod p of nonzero ``values`` with one modular inversion (Montgomery's trick): 3 multiplications
    a value instead of an inversion each."""
    prefix = [1]
    for v in values:
        prefix.append(prefix[-1] * v % PRIME)
    inv = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inv * prefix[i] % PRIME
        inv = inv * values[i] % PRIME
    return out


def _weights(xs: Sequence[int]) -> list[int]:
    """The barycentric weights ``w_i = 1 / prod_{j != i} (x_i - x_j)`` mod p of distinct ``xs``."""
    dens = []
    for xi in xs:
        d = 1
        for xj in xs:
            if xj != xi:
                d = d * (xi - xj) % PRIME
        dens.append(d)
    return _batch_inverse(dens)


def _basis_at(xs: Sequence[int], weights: Sequence[int], x: int) -> list[int]:
    """``L_i(x) = w_i prod_{j != i} (x - x_j)`` mod p for each node (prefix and suffix products: no inversion)."""
    n = len(xs)
    prefix, suffix = [1] * (n + 1), [1] * (n + 1)
    for i in range(n):
        prefix[i + 1] = prefix[i] * (x - xs[i]) % PRIME
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] * (x - xs[i]) % PRIME
    return [weights[i] * prefix[i] % PRIME * suffix[i + 1] % PRIME for i in range(n)]


def lagrange_at_zero(xs: Sequence[int]) -> dict[int, int]:
    """The Lagrange basis values ``L_i(0) = prod_{j != i} x_j / (x_j - x_i)`` mod p, keyed by x_i."""
    _check_xs(xs)
    xs = list(xs)
    return dict(zip(xs, _basis_at(xs, _weights(xs), 0)))


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
    return evaluate_many(shares, [x])[x]


def evaluate_many(shares: Mapping[int, int], points: Sequence[int]) -> dict[int, int]:
    """:func:`evaluate` at each of ``points``; the weights are computed once (one inversion in all), each point
    then costs O(len(shares)) multiplications."""
    xs = sorted(shares)
    _check_xs(xs)
    weights = _weights(xs)
    ys = [shares[xi] for xi in xs]
    return {x: sum(y * b for y, b in zip(ys, _basis_at(xs, weights, x))) % PRIME for x in points}


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
