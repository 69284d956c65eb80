"""Everything that belongs to the round in progress, in one object the coordinator replaces per round.

:class:`OpenRound` holds the selection, the engine's open aggregate (:class:`flayer.engine.OpenAggregate`),
the intake context, the per-round statistics, the timer and the round's journal. In asynchronous
rounds it is the buffer of one model version: updates trained from older versions are journaled
under the round they were trained from and folded with their staleness weight.
:meth:`OpenRound.accept` is the one path an update takes into the aggregate -- journal (fsync) first, then fold -- and :meth:`OpenRound.replay`
re-folds a journal after a restart through the same validation (quarantined records skipped).
:meth:`OpenRound.close` checks that the next global model is finite; when it is not, the round's
journal is folded again one update at a time and the updates that make it non-finite are quarantined
(:mod:`coordinator.guard`), so neither this run nor a restart publishes or checkpoints such a model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flayer.aggregate import is_finite_state
from flayer.engine import Bounds, OpenAggregate, Verdict
from flayer.engine.privacy import UNCLIPPED_KEY, RoundPrivacy, server_bound
from flayer.strategies.base import Strategy
from flayer.update import Update
from protocol import Kind, Plan, WireError, WireLimits, decode_message, payload_bound

from .config import FederationSettings
from .guard import Quarantine, finite_fold
from .intake import IntakeContext, validate
from .journal import Journal, JournalRecord, JournalReplay, journal_path, read_journal
from .metrics import RoundStats
from .rounds import Announcements, RoundTimer
from .secure_round import SecureRound

__all__ = ["OpenRound", "folded_in", "journaled_round", "journaled_selection"]

log = logging.getLogger(__name__)


@dataclass
class OpenRound:
    number: int
    selected: frozenset[str]
    aggregate: OpenAggregate
    ctx: IntakeContext
    stats: RoundStats
    accepted: set[str] = field(default_factory=set)
    timer: RoundTimer | None = None
    journal: Journal | None = None
    journal_dir: Path | None = None
    norms: list[float] = field(default_factory=list)  # of the accepted updates
    norm_clients: list[str] = field(default_factory=list)  # ... whose each is (coordinator.guard, rule 4)
    on_fold: Callable[[str, int], None] | None = None  # (client, base round): asynchronous bookkeeping
    secure: SecureRound | None = None  # a secure round's protocol (its updates are masked inputs)
    evals: set[str] = field(default_factory=set)  # secure rounds: who reported its evaluation (Metrics)

    @classmethod
    def begin(cls, number: int, selected: tuple[str, ...] | list[str], strategy: Strategy,
              global_state: Mapping[str, torch.Tensor], model_digest: str, fs: FederationSettings, federation: str,
              limits: WireLimits, now: float, norm_bound: float | None = None,
              bases: Mapping[int, str] | None = None, privacy: RoundPrivacy | None = None,
              noise_seed: int | None = None) -> OpenRound:
        """``norm_bound``: the round's bound (explicit or automatic, :class:`coordinator.guard.NormHistory`);
        ``bases``: the model digests of the versions updates may be trained from (asynchronous rounds;
        synchronous: this round's model only); ``privacy``: a private round, every update clipped to the
        server bound (device clipping is not trusted) and the sum noised from the operating system's CSPRNG
        (``noise_seed``: tests only; a seed a plan reader knows makes the noise replayable)."""
        agg = OpenAggregate(strategy, global_state, privacy, noise_seed)
        sel = frozenset(selected)
        staleness = fs.async_settings.max_staleness if fs.mode == "async" else 0
        bounds = Bounds(norm_bound, fs.norm_policy, fs.max_samples, staleness, fs.staleness) if privacy is None \
            else Bounds(server_bound(privacy, agg.coordinates), "clip", fs.max_samples, staleness, fs.staleness)
        ctx = IntakeContext(federation, number, dict(bases or {number: model_digest}), agg.shapes, limits,
                            fs.max_update_bytes, bounds, payload_bound(agg.shapes))
        return cls(number, sel, agg, ctx, RoundStats(number, sorted(sel), now, tally=agg.tally))

    def start_timer(self, fs: FederationSettings, now: float) -> RoundTimer:
        self.timer = RoundTimer(now, now + fs.deadline_s, len(self.selected), fs.quorum, fs.grace_s, fs.min_updates,
                                fs.extend_s, announce_wait_s=fs.announce_wait_s,
                                announced=Announcements(self.number, frozenset(self.selected)), arrived=self.accepted)
        self.timer.accepted(len(self.accepted), now)
        return self.timer

    def open_journal(self, folder: Path) -> Journal:
        self.journal = Journal(folder, self.number)
        self.journal_dir = folder
        return self.journal

    def fold(self, client: str, verdict: Verdict, base: int) -> None:
        """Fold an update that :func:`coordinator.intake.validate` accepted (trained from round ``base``). In a
        private round only its values and clip bit count: an evaluation or loss it reports anyway (a device of
        an earlier release) is left out of the record (docs/reference/private-fields.md)."""
        if self.aggregate.privacy is not None and verdict.update is not None:
            up = verdict.update
            verdict = dataclasses.replace(verdict, update=Update(up.deltas, up.num_samples, {
                k: v for k, v in up.info.items() if k == UNCLIPPED_KEY}))
        self.aggregate.fold(verdict, client)
        self.accepted.add(client)
        self.norms.append(verdict.norm)
        self.norm_clients.append(client)
        if self.on_fold is not None:
            self.on_fold(client, base)

    def accept(self, client: str, base: int, blob: bytes, verdict: Verdict, now: float) -> None:
        """Journal (append + fsync), then fold: the caller acks only after this returns. A secure round's
        masked input is journaled and counted; only the round's unmasked sum is folded (:meth:`fold_secure`)."""
        assert self.journal is not None
        self.journal.append_update(client, base, blob)
        if self.secure is not None:
            self.accepted.add(client)
        else:
            assert verdict.update is not None
            self.fold(client, verdict, base)
        if self.timer is not None:
            self.timer.accepted(len(self.accepted), now)

    def _valid(self, records: list[JournalRecord], quarantine: Quarantine) -> Iterator[tuple[JournalRecord, Verdict]]:
        for rec in records:
            if rec.round not in self.ctx.bases or (rec.round, rec.client, rec.digest) in quarantine:
                continue
            verdict = validate(rec.client, rec.data, self.ctx, rec.round)
            if not verdict.accepted or verdict.update is None:
                log.error("journal of round %d: the update of %s no longer validates (%s)", self.number,
                          rec.client, verdict.reason)
                continue
            yield rec, verdict

    def replay(self, replay: JournalReplay, quarantine: Quarantine) -> int:
        """Fold the journaled updates of this round again (same validation, quarantined ones left out);
        returns how many."""
        seen: set[tuple[str, int]] = set()
        for rec, verdict in self._valid(replay.updates, quarantine):
            if (rec.client, rec.round) not in seen:
                seen.add((rec.client, rec.round))
                self.fold(rec.client, verdict, rec.round)
        return len(seen)

    def close(self, quarantine: Quarantine) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(the next global state, finite; the clients whose updates were quarantined to keep it so).
        The journal is closed (it stays on disk until pruned)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        result = self.aggregate.result()
        bad = is_finite_state(result)
        if bad is None:
            return result, []
        assert self.journal_dir is not None
        log.error("round %d: the aggregate is not finite (tensor %r); folding the journal again", self.number, bad)
        records = read_journal(journal_path(self.journal_dir, self.number)).updates

        def fold_of(v: Verdict) -> Callable[[Any], None]:
            return lambda agg: agg.fold(v.update, weight=v.weight)

        def folds() -> Iterator[tuple[tuple[str, str], Callable[[Any], None]]]:
            for rec, verdict in self._valid(records, quarantine):
                yield (rec.client, rec.digest), fold_of(verdict)

        self.aggregate.aggregator, left_out = finite_fold(self.aggregate.fresh, folds())
        for client, digest in left_out:
            quarantine.add(self.number, client, digest, f"with it the aggregate's tensor {bad!r} is not finite")
            self.accepted.discard(client)
        self.aggregate.tally.remove(len(left_out))
        self.stats.rejected["quarantined"] += len(left_out)
        return self.aggregate.result(), [c for c, _ in left_out]


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
    """Who was folded, by the round each update was trained from, in the journals of ``rounds`` still on
    disk (after a restart, a device re-sending one of those updates is told ``duplicate``, as before it,
    not ``late``)."""
    out: dict[int, set[str]] = {}
    for r in rounds:
        path = journal_path(folder, r)
        if path.exists():
            for rec in read_journal(path).updates:
                out.setdefault(rec.round, set()).add(rec.client)
    return out


def journaled_selection(replay: JournalReplay, limits: WireLimits) -> set[str]:
    """Every device any plan in a journal selected (asynchronous rounds write a plan per change of slots)."""
    out: set[str] = set()
    for payload in replay.plans:
        try:
            _, plan = decode_message(payload, limits, Kind.PLAN)
        except WireError:
            continue
        assert isinstance(plan, Plan)
        out.update(plan.selected)
    return out
