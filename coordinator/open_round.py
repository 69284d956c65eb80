"""Everything that belongs to the round in progress, in one object the coordinator replaces per round.

:class:`OpenRound` holds the selection, the strategy's streaming aggregator, the intake context, the
per-round statistics, the timer and the round's journal. :meth:`OpenRound.accept` is the one path
an update takes into the aggregate -- journal (fsync) first, then fold -- and :meth:`OpenRound.replay`
re-folds a journal after a restart through the same validation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flayer.strategies.base import Strategy
from flayer.update import Update
from protocol import Kind, Plan, WireError, WireLimits, decode_message

from .config import FederationSettings
from .intake import IntakeContext, Verdict, validate
from .journal import Journal, JournalReplay, journal_path, read_journal
from .metrics import RoundStats
from .rounds import RoundTimer

__all__ = ["OpenRound", "folded_in", "journaled_round"]

log = logging.getLogger(__name__)


@dataclass
class OpenRound:
    number: int
    selected: frozenset[str]
    aggregator: Any  # flayer.aggregate.Aggregator (or a strategy's own, same interface)
    ctx: IntakeContext
    stats: RoundStats
    accepted: set[str] = field(default_factory=set)
    timer: RoundTimer | None = None
    journal: Journal | None = None

    @classmethod
    def begin(cls, number: int, selected: tuple[str, ...] | list[str], strategy: Strategy,
              global_state: Mapping[str, torch.Tensor], model_digest: str, fs: FederationSettings, federation: str,
              limits: WireLimits, now: float) -> OpenRound:
        agg = strategy.aggregator(global_state, fs.norm_bound)
        sel = frozenset(selected)
        ctx = IntakeContext(federation, number, model_digest, agg.shapes, limits, fs.max_update_bytes, fs.norm_bound,
                            fs.norm_policy, sel)
        return cls(number, sel, agg, ctx, RoundStats(number, sorted(sel), now))

    def start_timer(self, fs: FederationSettings, now: float) -> RoundTimer:
        self.timer = RoundTimer(now, now + fs.deadline_s, len(self.selected), fs.quorum, fs.grace_s, fs.min_updates,
                                fs.extend_s)
        self.timer.accepted(len(self.accepted), now)
        return self.timer

    def open_journal(self, folder: Path) -> Journal:
        self.journal = Journal(folder, self.number)
        return self.journal

    def fold(self, client: str, update: Update, clipped: bool = False, norm: float | None = None) -> None:
        """Fold an update that :func:`coordinator.intake.validate` accepted (``norm``: its checked norm)."""
        self.aggregator.fold(update, checked_norm=norm)
        self.accepted.add(client)
        self.stats.accepted += 1
        self.stats.clipped += int(clipped)
        self.stats.add_eval(update.info, client)

    def accept(self, client: str, blob: bytes, verdict: Verdict, now: float) -> None:
        """Journal (append + fsync), then fold: the caller acks only after this returns."""
        assert self.journal is not None and verdict.update is not None
        self.journal.append_update(client, self.number, blob)
        self.fold(client, verdict.update, verdict.clipped, verdict.norm)
        if self.timer is not None:
            self.timer.accepted(len(self.accepted), now)

    def replay(self, replay: JournalReplay) -> int:
        """Fold the journaled updates of this round again (same validation); returns how many."""
        for rec in replay.updates:
            if rec.round != self.number or rec.client in self.accepted:
                continue
            verdict = validate(rec.client, rec.data, self.ctx)
            if not verdict.accepted or verdict.update is None:
                log.error("journal of round %d: the update of %s no longer validates (%s)", self.number,
                          rec.client, verdict.reason)
                continue
            self.fold(rec.client, verdict.update, verdict.clipped, verdict.norm)
        return len(self.accepted)

    def close(self) -> dict[str, torch.Tensor]:
        """The next global state; the journal is closed (it stays on disk until pruned)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        return self.aggregator.result()


def journaled_round(folder: Path, number: int, limits: WireLimits, model_digest: str
                    ) -> tuple[Plan, JournalReplay] | None:
    """The plan and records of round ``number``'s journal, if it was opened for the model ``model_digest``
    (after a crash: the same selection, and the updates to fold again). RuntimeError if unreadable."""
    path = journal_path(folder, number)
    if not path.exists():
        return None
    replay = read_journal(path)
    if replay.plan is None:
        return None
    try:
        _, plan = decode_message(replay.plan, limits, Kind.PLAN)
    except WireError as exc:
        raise RuntimeError(f"journal {path}: unreadable plan ({exc.reason})") from None
    assert isinstance(plan, Plan)
    if plan.model_digest != model_digest or plan.round != number:
        log.warning("journal %s is for another model; round %d starts afresh", path, number)
        return None
    return plan, replay


def folded_in(folder: Path, rounds: range) -> dict[int, set[str]]:
    """Who was folded in each closed round of ``rounds`` whose journal is still on disk (after a restart,
    a device re-sending one of those updates is told ``duplicate``, as before it, not ``late``)."""
    out: dict[int, set[str]] = {}
    for r in rounds:
        path = journal_path(folder, r)
        if path.exists():
            out[r] = {rec.client for rec in read_journal(path).updates if rec.round == r}
    return out
