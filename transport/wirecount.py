"""Every byte an MQTT connection moves, counted where paho reads and writes its socket.

:func:`count_wire_bytes` wraps one paho client's socket reads and writes (paho 2.x's
``_sock_recv`` / ``_sock_send``, the only two places its network side touches the socket) so that
each call reports the bytes it actually moved: ``on_bytes(n, "up")`` for what the client sent,
``on_bytes(n, "down")`` for what it received. That is every MQTT packet -- CONNECT, PUBLISH,
PUBACK, SUBSCRIBE, PINGREQ, the packets paho re-sends after a reconnect and the broker's
re-deliveries -- with its fixed header, topic and payload; with TLS it is the plaintext MQTT
stream (the TLS records' own overhead is not seen). :class:`WireBytes` is a thread-safe running
total of both directions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["WireBytes", "count_wire_bytes"]


class WireBytes:
    """Running totals of the bytes sent (``up``) and received (``down``); thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.up = 0
        self.down = 0

    def add(self, nbytes: int, direction: str) -> None:
        with self._lock:
            if direction == "up":
                self.up += nbytes
            else:
                self.down += nbytes

    def snapshot(self) -> tuple[int, int]:
        """(up, down) so far."""
        with self._lock:
            return self.up, self.down


def count_wire_bytes(client: Any, on_bytes: Callable[[int, str], None]) -> None:
    """Report every socket read and write of the paho ``client`` to ``on_bytes(nbytes, direction)``.

    Raises TypeError for a client without paho 2.x's socket methods (nothing is wrapped then)."""
    recv, send = getattr(client, "_sock_recv", None), getattr(client, "_sock_send", None)
    if not callable(recv) or not callable(send):
        raise TypeError(f"{type(client).__name__} has no paho 2.x socket methods to count bytes on")

    def counted_recv(bufsize: int) -> bytes:
        data = recv(bufsize)
        if data:
            on_bytes(len(data), "down")
        return data

    def counted_send(buf: bytes | bytearray) -> int:
        n = send(buf)
        if n:
            on_bytes(int(n), "up")
        return n

    client._sock_recv = counted_recv
    client._sock_send = counted_send
