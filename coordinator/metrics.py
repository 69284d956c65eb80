"""Per-round statistics, cumulative counters and the metrics JSONL file.

One line per closed round in ``<state_dir>/metrics.jsonl``: round, selected, received (complete
blobs), accepted, rejected by reason, bytes in (update chunks received) and out (model and plan
published), sample-weighted test accuracy the devices reported (measured after the download,
before training, as ``flayer simulate`` does), mean training loss, why the round closed, wall
time, and the cumulative counters.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "RoundStats"]


@dataclass
class RoundStats:
    round: int
    selected: list[str] = field(default_factory=list)
    opened_at: float = 0.0
    received: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    model_bytes: int = 0
    correct: float = 0.0
    total: float = 0.0
    losses: list[float] = field(default_factory=list)
    clipped: int = 0
    weight_capped: int = 0  # accepted updates whose num_samples was cut to max_samples

    def add_eval(self, info: Mapping[str, float]) -> None:
        """Fold a device's reported evaluation (``test_correct``, ``test_total``, ``train_loss``)."""
        c, t = info.get("test_correct"), info.get("test_total")
        if c is not None and t is not None and t > 0 and 0 <= c <= t:
            self.correct += float(c)
            self.total += float(t)
        loss = info.get("train_loss")
        if loss is not None and math.isfinite(loss):
            self.losses.append(float(loss))

    @property
    def acc(self) -> float | None:
        return self.correct / self.total if self.total else None

    @property
    def train_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def as_dict(self, closed_at: float, reason: str, counters: Mapping[str, int]) -> dict[str, Any]:
        return {"round": self.round, "selected": self.selected, "received": self.received,
                "accepted": self.accepted, "rejected": dict(self.rejected), "clipped": self.clipped,
                "weight_capped": self.weight_capped,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "model_bytes": self.model_bytes,
                "acc": self.acc, "train_loss": self.train_loss, "closed": reason,
                "wall_s": round(closed_at - self.opened_at, 3), "counters": dict(counters)}


class MetricsLog:
    """Appends JSON lines to ``path`` (flushed per line)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "a")

    def write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
