"""The queue between the MQTT callbacks (paho's network thread) and the coordinator's worker.

Bounded in bytes, in total (``queue_bytes``) and per sender (``queue_sender_bytes``): a message that
would go over either is dropped and counted (``queue_full``, by sender), so a device flooding the
coordinator holds at most its share of memory and an honest device's messages still find room.
The worker takes messages round-robin across senders, so one sender's backlog does not delay the
others' updates (and their acknowledgements) behind it. Link events (connect, disconnect) and the
stop request are not messages: they are never dropped and come out first.

The sender of a message is the client id its topic names (``fl/<federation>/<kind>/<client>/...``);
topics without one share the key ``""``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

__all__ = ["ReceiveQueue", "sender_of"]

_OVERHEAD = 200  # bytes per queued message beyond its payload and topic (the objects around them)


def sender_of(topic: str) -> str:
    """The client id a federation topic names (its fourth level), or ``""``."""
    parts = topic.split("/", 4)
    return parts[3] if len(parts) > 3 else ""


class ReceiveQueue:
    """``put`` from any thread (never blocks); ``get`` from the worker. Messages are objects with
    ``topic`` and ``payload`` attributes; anything else is a control event."""

    def __init__(self, max_bytes: int, max_sender_bytes: int) -> None:
        if not 1 <= max_sender_bytes <= max_bytes:
            raise ValueError(f"need 1 <= max_sender_bytes ({max_sender_bytes}) <= max_bytes ({max_bytes})")
        self.max_bytes, self.max_sender_bytes = max_bytes, max_sender_bytes
        self._cond = threading.Condition()
        self._control: deque[Any] = deque()
        self._by_sender: dict[str, deque[tuple[Any, int]]] = {}
        self._turn: deque[str] = deque()  # senders with something queued, in round-robin order
        self._sender_bytes: Counter[str] = Counter()
        self.bytes = 0
        self.peak_bytes = 0
        self._dropped: Counter[str] = Counter()  # since the last take_dropped()

    def put(self, item: Any) -> bool:
        """Queue ``item``; False when it was dropped (over the total or the sender's share)."""
        payload = getattr(item, "payload", None)
        with self._cond:
            if payload is None:
                self._control.append(item)
                self._cond.notify()
                return True
            topic = str(getattr(item, "topic", ""))
            key, size = sender_of(topic), len(payload) + len(topic) + _OVERHEAD
            if self.bytes + size > self.max_bytes or self._sender_bytes[key] + size > self.max_sender_bytes:
                self._dropped[key] += 1
                return False
            q = self._by_sender.get(key)
            if q is None:
                q = self._by_sender[key] = deque()
                self._turn.append(key)
            q.append((item, size))
            self._sender_bytes[key] += size
            self.bytes += size
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self._cond.notify()
            return True

    def get(self, timeout: float) -> Any:
        """The next control event, else the next sender's oldest message; None after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._control and not self._turn:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            if self._control:
                return self._control.popleft()
            key = self._turn.popleft()
            q = self._by_sender[key]
            item, size = q.popleft()
            if q:
                self._turn.append(key)
            else:
                del self._by_sender[key]
            self._sender_bytes[key] -= size
            if not self._sender_bytes[key]:
                del self._sender_bytes[key]
            self.bytes -= size
            return item

    def take_dropped(self) -> Counter[str]:
        """Messages dropped per sender since the last call."""
        with self._cond:
            out, self._dropped = self._dropped, Counter()
            return out

    def __len__(self) -> int:
        with self._cond:
            return len(self._control) + sum(len(q) for q in self._by_sender.values())
