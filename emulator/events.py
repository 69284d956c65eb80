"""JSON-lines event files: the emulator's processes write them, the launcher follows them.

Each line is one JSON object with at least ``t`` (wall-clock time, seconds since the epoch) and
``kind``. Workers write ``online``, ``offline``, ``crash``, ``compute``, ``trained``, ``ack``,
``finished``, ``error``, ``bytes`` (cumulative bytes per round and direction) and ``stats`` (memory,
threads, connections); the coordinator process writes ``open`` (with the selected ids and the
number of devices online), ``accepted``, ``round`` (its metrics record), ``waiting`` and ``done``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "JsonlTail", "read_jsonl"]


class EventLog:
    """Appends events to ``path``, one flushed line each; safe to call from any thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": round(time.time(), 3), "kind": kind, **fields}, sort_keys=True, default=str)
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line + "\n")
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


class JsonlTail:
    """New complete lines of a growing JSONL file since the last call (a torn last line waits)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue  # not ours to judge: skip a garbled line
                if isinstance(obj, dict):
                    out.append(obj)
        return out


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    tail = JsonlTail(path)
    yield from tail.read()
