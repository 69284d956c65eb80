"""The mask generator PRG(seed) -> Z_{2^32}^n, and the entropy sources the protocol draws from.

:func:`expand` is the ChaCha20 keystream (RFC 8439; key = the 32-byte seed, nonce and counter 0)
read as little-endian uint32: a cryptographic PRG, so masks built from it are computationally
indistinguishable from uniform (Bonawitz et al., CCS 2017, Sec. 3, "PRG"). One seed is never used for
two streams: self-mask seeds are fresh random bytes and pairwise seeds come out of HKDF with the
round in the info (:mod:`.keys`). The keystream runs at OpenSSL speed; n = 10^7 is ~40 MB of output.

An ``Entropy`` is a callable ``entropy(n) -> n random bytes`` (``os.urandom`` in deployment).
:class:`SeededEntropy` is a reproducible one for tests and simulations only: anyone who knows its
seed knows every key and mask drawn from it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

__all__ = ["MAX_LENGTH", "SEED_LEN", "Entropy", "KeystreamRandom", "SeededEntropy", "expand", "randbelow_from"]

SEED_LEN = 32
MAX_LENGTH = 1 << 26  # coordinates of one vector (256 MiB of uint32)
_NONCE = bytes(16)  # the 4-byte counter and 12-byte nonce of the cryptography library's ChaCha20

Entropy = Callable[[int], bytes]


def _keystream(seed: bytes, nbytes: int) -> bytearray:
    out = bytearray(nbytes)
    if nbytes:
        encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
        encryptor.update_into(bytes(nbytes), out)  # ChaCha20 is a stream cipher: out is exactly nbytes
    return out


def expand(seed: bytes, n: int) -> np.ndarray:
    """``n`` uint32 values of the ChaCha20 keystream under ``seed`` (a writable array)."""
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_LEN:
        raise ValueError(f"seed must be {SEED_LEN} bytes")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LENGTH:
        raise ValueError(f"n must be an integer in [0, {MAX_LENGTH}], got {n!r}")
    return np.frombuffer(_keystream(bytes(seed), 4 * n), dtype="<u4").astype(np.uint32, copy=False)


class SeededEntropy:
    """A reproducible byte stream (ChaCha20 under ``seed``) standing in for ``os.urandom`` in tests."""

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_LEN:
            raise ValueError(f"seed must be {SEED_LEN} bytes")
        self._encryptor = Cipher(algorithms.ChaCha20(bytes(seed), _NONCE), mode=None).encryptor()

    def __call__(self, n: int) -> bytes:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        return self._encryptor.update(bytes(n))


def randbelow_from(entropy: Entropy) -> Callable[[int], int]:
    """A ``secrets.randbelow``-like draw built on ``entropy`` (rejection sampling: exactly uniform)."""

    def randbelow(bound: int) -> int:
        if not isinstance(bound, int) or bound < 1:
            raise ValueError(f"bound must be an integer >= 1, got {bound!r}")
        bits = (bound - 1).bit_length()
        nbytes = (bits + 7) // 8
        while True:
            value = int.from_bytes(entropy(nbytes), "big") & ((1 << bits) - 1)
            if value < bound:
                return value

    return randbelow


class KeystreamRandom:
    """The draws a device's secret-dependent randomness needs (``random`` and ``geometric``, as numpy's
    ``Generator`` names them: stochastic rounding and discrete Gaussian noise), from the ChaCha20 keystream under
    a 32-byte key -- fresh from ``os.urandom`` by default. A cryptographic generator: unlike numpy's PCG64, its
    outputs reveal nothing of its state, so no output predicts another."""

    def __init__(self, key: bytes | None = None) -> None:
        key = os.urandom(SEED_LEN) if key is None else key
        if not isinstance(key, (bytes, bytearray)) or len(key) != SEED_LEN:
            raise ValueError(f"key must be {SEED_LEN} bytes")
        self._encryptor = Cipher(algorithms.ChaCha20(bytes(key), _NONCE), mode=None).encryptor()

    def random(self, size: int | tuple[int, ...]) -> np.ndarray:
        """Uniform floats in [0, 1): 53 bits of a keystream word each."""
        n = int(np.prod(size))
        words = np.frombuffer(self._encryptor.update(bytes(8 * n)), dtype="<u8")
        return ((words >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(size)

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: int | tuple[int, ...] | None = None
               ) -> np.ndarray | float:
        """Gaussian draws (numpy's ``Generator.normal`` signature), by the Box-Muller transform of keystream uniforms:
        the privacy noise of central and local DP. A float when ``size`` is None."""
        n = 1 if size is None else int(np.prod(size))
        m = (n + 1) // 2
        u1, u2 = 1.0 - self.random(m), self.random(m)  # u1 in (0, 1]: log never sees 0
        r = np.sqrt(-2.0 * np.log(u1))
        z = np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)])[:n]
        out = loc + scale * z
        return float(out[0]) if size is None else out.reshape(size)

    def geometric(self, p: float, size: int) -> np.ndarray:
        """Trials to the first success of probability ``p`` (>= 1), by inversion: ceil(ln(1-u) / ln(1-p))."""
        if not 0 < p <= 1:
            raise ValueError(f"p must be in (0, 1], got {p!r}")
        if p == 1:
            return np.ones(size, dtype=np.int64)
        u = self.random(size)
        return np.maximum(1.0, np.ceil(np.log1p(-u) / math.log1p(-p))).astype(np.int64)
