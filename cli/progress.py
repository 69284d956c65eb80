"""A small progress display on stderr: redraws one line on a terminal, prints milestones otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 28) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self.note = ""
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_pct = -1

    def update(self, done: int, note: str | None = None) -> None:
        self.done = min(done, self.total)
        if note is not None:
            self.note = note
        frac = self.done / self.total
        elapsed = time.monotonic() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        if self.tty:
            filled = int(self.width * frac)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s "
                              f"eta {eta:4.0f}s {self.note}\x1b[K")
            self.stream.flush()
        else:
            pct = int(frac * 10)
            if pct != self._last_pct:
                self._last_pct = pct
                self.stream.write(f"{self.label} {self.done}/{self.total} ({elapsed:.0f}s) {self.note}\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
