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

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flayer.engine import RoundTally
from protocol.metrics_schema import MetricsFile, round_record

__all__ = ["MetricsLog", "RoundStats"]

class MetricsLog(MetricsFile):
    """The coordinator's metrics file: an I/O error (a full disk) is raised as OSError naming it."""

    def write(self, record: Mapping[str, Any]) -> None:
        try:
            super().write(record)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from exc


@dataclass
class RoundStats:
    """A round's transport counters beside the engine's tally of what was folded (one record)."""

    round: int
    selected: list[str] = field(default_factory=list)
    opened_at: float = 0.0
    received: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    model_bytes: int = 0
    refusals: list[dict[str, str]] = field(default_factory=list)  # the latest, with reasons
    refused_by: dict[str, str] = field(default_factory=dict)  # device -> its last refusal's counter
    tally: RoundTally = field(default_factory=RoundTally)  # the folded updates (flayer.engine)
    mode: str = "sync"
    wire_from: tuple[int, int] | None = None  # the connection's (sent, received) byte totals at the round's open
    wire_to: tuple[int, int] | None = None  # ... and at its close
    extra: dict[str, Any] = field(default_factory=dict)  # more fields of the record (a secure round's outcome)

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

    def as_dict(self, closed_at: float, reason: str, counters: Mapping[str, int],
                accepted: Iterable[str] = ()) -> dict[str, Any]:
        """The round's line of the metrics file (``accepted``: the devices whose update was folded in)."""
        done, t = set(accepted), self.tally
        up, down = self.bytes_in, self.bytes_out
        if self.wire_from is not None and self.wire_to is not None:
            down, up = (b - a for a, b in zip(self.wire_from, self.wire_to))
        rows = [{"id": c, "result": "accepted" if c in done else
                 "late" if self.refused_by.get(c) in ("late", "stale") else "refused" if c in self.refused_by
                 else "missing", "acc": t.device_acc.get(c)} for c in self.selected]
        return round_record(
            "coordinator", closed_at, round=self.round, wall_s=closed_at - self.opened_at, selected=self.selected,
            devices=rows, refused=self.rejected, bytes_up=up, bytes_down=down, acc=t.acc,
            train_loss=t.train_loss, closed=reason, late=self.rejected.get("late", 0), refusals=self.refusals,
            received=self.received, accepted=t.accepted, rejected=dict(self.rejected), clipped=t.clipped,
            weight_capped=t.weight_capped, mode=self.mode, staleness_mean=t.mean_staleness,
            stale=self.rejected.get("stale", 0),
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, model_bytes=self.model_bytes, counters=dict(counters),
            **self.extra)
