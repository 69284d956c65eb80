"""Link shaping for an emulated device: a token bucket per direction plus a fixed latency.

The edge client asks its ``shaper(nbytes, direction)`` for a delay before publishing each chunk
("up", on its job thread) and after receiving each model chunk ("down", on its worker thread), and
sleeps that long. :class:`LinkShaper` answers with the token bucket's wait plus the direction's
latency:

- the bucket fills at the link's rate (bytes per second) up to ``burst`` bytes and starts empty;
  a message of ``n`` bytes takes ``n`` tokens, and when there are too few the tokens go negative
  and the sender waits until the debt is repaid -- so ``k`` back-to-back messages of ``n`` bytes
  take at least ``(k n - burst) / rate`` seconds, whatever their size;
- latency (one-way) is added once per message: chunks are sent one after the other, each after its
  own delay, which is how a stop-and-wait sender on a long link behaves (PUBACKs are not delayed).

A rate of 0 means unshaped. Every call also reports the bytes to ``on_bytes`` when given (the
emulator counts bytes on the socket instead, :mod:`transport.wirecount`, so that every MQTT packet
and re-send is in its totals). Thread safe: one lock per direction.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .profiles import DeviceProfile

__all__ = ["LinkShaper", "TokenBucket"]


class TokenBucket:
    """Tokens in bytes; ``rate`` bytes/s (> 0), depth ``burst`` bytes (>= 0), starts empty."""

    def __init__(self, rate: float, burst: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or burst < 0:
            raise ValueError(f"token bucket needs rate > 0 and burst >= 0, got {rate}, {burst}")
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens = 0.0
        self.last = clock()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Take ``nbytes`` tokens; returns how long the sender must wait before sending."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens -= nbytes
            return max(0.0, -self.tokens / self.rate)


class LinkShaper:
    """The ``shaper`` of one device's :class:`edge_client.client.EdgeClient` (see module docstring)."""

    def __init__(self, profile: DeviceProfile, clock: Callable[[], float] = time.monotonic,
                 on_bytes: Callable[[int, str], None] | None = None) -> None:
        burst = profile.burst_kb * 1024
        self.buckets = {
            "up": TokenBucket(profile.up_mbps * 1e6 / 8, burst, clock) if profile.up_mbps > 0 else None,
            "down": TokenBucket(profile.down_mbps * 1e6 / 8, burst, clock) if profile.down_mbps > 0 else None,
        }
        self.latency = {"up": profile.up_latency_ms / 1000, "down": profile.down_latency_ms / 1000}
        self.on_bytes = on_bytes

    def __call__(self, nbytes: int, direction: str) -> float:
        if direction not in self.buckets:
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        if self.on_bytes is not None:
            self.on_bytes(nbytes, direction)
        bucket = self.buckets[direction]
        return (bucket.take(nbytes) if bucket is not None else 0.0) + self.latency[direction]
