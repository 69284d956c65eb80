"""Per-round statistics, cumulative counters and the metrics JSONL file.

``<state_dir>/metrics.jsonl`` follows the metrics schema (:mod:`protocol.metrics_schema`,
``docs/reference/metrics.md``): a ``run`` line per start, one ``round`` line per closed round and an
``end`` line. A round line holds the common fields (selected, reported, refusals with reasons,
bytes up = update chunks received, bytes down = model and plan published, the sample-weighted test
accuracy the devices reported -- measured after the download, before training, as ``flayer
simulate`` does --, per-device rows) and the coordinator's own: received (complete blobs), accepted,
rejected by reason, clipped, bytes_in, bytes_out, model_bytes and the cumulative counters.

Bytes up / down: every byte the coordinator's connection received / sent while the round was open
(:mod:`transport.wirecount`: updates and their re-sends, statuses, metrics, acks, the model, its
delta and the plan, MQTT framing, PUBACKs and pings included); ``bytes_in`` / ``bytes_out`` keep the
payloads alone (update chunks received; model, delta and plan published). Without a socket count
(a round replayed from the journal before it reopened) bytes up / down are those payloads.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.metrics_schema import MetricsFile, round_record

__all__ = ["MetricsLog", "RoundStats"]

MetricsLog = MetricsFile  # the coordinator's metrics file (kept under its old name)


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
    refusals: list[dict[str, str]] = field(default_factory=list)  # the latest, with reasons
    refused_by: dict[str, str] = field(default_factory=dict)  # device -> its last refusal's counter
    device_acc: dict[str, float] = field(default_factory=dict)  # device -> the accuracy it reported
    weight_capped: int = 0  # accepted updates whose num_samples was cut to max_samples
    wire_from: tuple[int, int] | None = None  # the connection's (sent, received) byte totals at the round's open
    wire_to: tuple[int, int] | None = None  # ... and at its close

    def refuse(self, counter: str, detail: str, client: str | None = None, n: int = 1) -> None:
        self.rejected[counter] += n
        self.note(counter, detail, client)
        if client is not None:
            self.refused_by[client] = counter

    def note(self, counter: str, detail: str, client: str | None) -> None:
        """Keep a refusal's reason among the latest 50 (a silent count, e.g. every chunk of a device cut off,
        has none and does not crowd out the others)."""
        if detail:
            self.refusals = [*self.refusals[-49:], {"reason": counter, "detail": detail[:300],
                                                    "device": client or ""}]

    def add_eval(self, info: Mapping[str, float], client: str | None = None) -> None:
        """Fold a device's reported evaluation (``test_correct``, ``test_total``, ``train_loss``)."""
        c, t = info.get("test_correct"), info.get("test_total")
        if c is not None and t is not None and t > 0 and 0 <= c <= t:
            self.correct += float(c)
            self.total += float(t)
            if client is not None:
                self.device_acc[client] = float(c) / float(t)
        loss = info.get("train_loss")
        if loss is not None and math.isfinite(loss):
            self.losses.append(float(loss))

    @property
    def acc(self) -> float | None:
        return self.correct / self.total if self.total else None

    @property
    def train_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def as_dict(self, closed_at: float, reason: str, counters: Mapping[str, int],
                accepted: Iterable[str] = ()) -> dict[str, Any]:
        """The round's line of the metrics file (``accepted``: the devices whose update was folded in)."""
        done = set(accepted)
        up, down = self.bytes_in, self.bytes_out
        if self.wire_from is not None and self.wire_to is not None:
            down, up = (b - a for a, b in zip(self.wire_from, self.wire_to))
        rows = [{"id": c, "result": "accepted" if c in done else
                 "late" if self.refused_by.get(c) == "late" else "refused" if c in self.refused_by else "missing",
                 "acc": self.device_acc.get(c)} for c in self.selected]
        return round_record(
            "coordinator", closed_at, round=self.round, wall_s=closed_at - self.opened_at, selected=self.selected,
            devices=rows, refused=self.rejected, bytes_up=up, bytes_down=down, acc=self.acc,
            train_loss=self.train_loss, closed=reason, late=self.rejected.get("late", 0), refusals=self.refusals,
            received=self.received, accepted=self.accepted, rejected=dict(self.rejected), clipped=self.clipped,
            weight_capped=self.weight_capped,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, model_bytes=self.model_bytes, counters=dict(counters))
