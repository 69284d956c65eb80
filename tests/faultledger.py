"""The figures of the fault-injection and security suite, one row per thing a test tried.

Tests record through the ``faults_ledger`` fixture (tests/conftest.py); when the environment variable
``FLAYER_FAULTS_LEDGER`` names a file, each row is appended to it as one JSON line, which
``benchmarks/faults.py`` reads back and tabulates. Three kinds of row:

- ``fault``: a fault injected into a live run (kill -9, link cut...): how many, whether the run
  completed, updates the devices saw acknowledged and updates the coordinator aggregated;
- ``bad_input``: payloads an authorised device published: how many, how many the coordinator
  rejected (each with a logged reason and a counter);
- ``unauthorised``: attempts outside a role (publish, read, connect): how many, how many succeeded;
- ``attack``: one hostile device's attack on a live federation: payloads sent, whether the run
  completed, honest updates of the attacked round lost, coordinator crashes, and (where the
  coordinator is its own process) its peak RSS in MB.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENV", "Ledger", "Row", "read_rows"]

ENV = "FLAYER_FAULTS_LEDGER"
KINDS = ("fault", "bad_input", "unauthorised", "attack")


@dataclass(frozen=True)
class Row:
    test: str
    kind: str  # fault | bad_input | unauthorised
    what: str
    tried: int
    ok: int  # fault: runs completed; bad_input: rejected; unauthorised: delivered (should be 0)
    acked: int | None = None  # fault rows: updates acknowledged to devices
    aggregated: int | None = None  # fault rows: updates in the aggregate
    honest_lost: int | None = None  # attack rows: honest updates of the attacked round not aggregated
    crashes: int | None = None  # attack rows: coordinator crashes
    peak_rss_mb: float | None = None  # attack rows: the coordinator process's peak RSS (None: in-process)


class Ledger:
    """Records rows for one test; appends them to ``$FLAYER_FAULTS_LEDGER`` when it is set."""

    def __init__(self, test: str, path: str | None = None) -> None:
        self.test = test
        self.path = Path(path) if path else None
        self.rows: list[Row] = []

    @classmethod
    def from_env(cls, test: str) -> Ledger:
        return cls(test, os.environ.get(ENV) or None)

    def _add(self, row: Row) -> None:
        if row.kind not in KINDS or row.tried < 0 or row.ok < 0:
            raise ValueError(f"bad ledger row {row}")
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(asdict(row), sort_keys=True) + "\n")

    def fault(self, what: str, injected: int, completed: bool, acked: int, aggregated: int) -> None:
        self._add(Row(self.test, "fault", what, injected, int(completed), acked, aggregated))

    def bad_input(self, what: str, tried: int, rejected: int) -> None:
        self._add(Row(self.test, "bad_input", what, tried, rejected))

    def unauthorised(self, what: str, tried: int, delivered: int) -> None:
        self._add(Row(self.test, "unauthorised", what, tried, delivered))

    def attack(self, what: str, sent: int, *, honest_lost: int, crashes: int, completed: bool = True,
               peak_rss_mb: float | None = None) -> None:
        self._add(Row(self.test, "attack", what, sent, int(completed), None, None, honest_lost, crashes,
                      peak_rss_mb))


def read_rows(path: str | Path) -> list[Row]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            data: dict[str, Any] = json.loads(line)
            rows.append(Row(**data))
    return rows
