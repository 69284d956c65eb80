"""The open round: the start (the checkpoint and the journal of an interrupted round), opening a round (its
open aggregate, journal, model and plan), closing it (fold, checkpoint, metrics), a calibration's result and
the end of the federation.

:class:`RoundCycle` owns the federation's progress (:class:`coordinator.state.Progress`) and the journal
folder; the round open now is kept by the inbox (:attr:`coordinator.inbox.Inbox.open`: it counts refusals into
the round's metrics), which only this part sets. It is called by the round loop
(:class:`coordinator.server.Coordinator`) and the message intake, and calls the parts it is given.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from flayer.engine import initial_global_state
from flayer.state import load_initial_model, save_model
from flayer.strategies import make_strategy
from protocol import Topics, WireLimits, encode_message
from protocol.signing import SigningKey
from transport.wirecount import WireBytes

from .async_rounds import AsyncVersions
from .calibration import CalibrationError, CalibrationPhase
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import CoordinatorConfig
from .exporter import FleetMetrics
from .guard import NormHistory, Quarantine
from .inbox import Inbox
from .journal import prune_journals
from .metrics import MetricsLog
from .open_round import OpenRound, folded_in, journaled_round, journaled_selection
from .privacy import FederationPrivacy
from .publish import model_blob
from .publishing import Publishing
from .registry import DeviceRegistry
from .result import CoordinatorError
from .round_log import closing_notes
from .rounds import select_devices
from .secure_phase import SecurePhase
from .state import Progress, identity

__all__ = ["RoundCycle"]

log = logging.getLogger("coordinator.server")


class RoundCycle:
    """Opens and closes the rounds (module docstring)."""

    def __init__(self, cfg: CoordinatorConfig, federation: str, sender: str, progress: Progress, *,
                 clock: Callable[[], float], limits: WireLimits, topics: Topics, signer: SigningKey,
                 inbox: Inbox, publishing: Publishing, calibration: CalibrationPhase, secure: SecurePhase,
                 versions: AsyncVersions | None,
                 privacy: FederationPrivacy | None, norms: NormHistory, quarantine: Quarantine,
                 registry: DeviceRegistry, counters: Counter[str], metrics: MetricsLog, exporter: FleetMetrics,
                 wire: WireBytes, resubscribe: Callable[[], None],
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg, self.fs, self.federation, self.sender = cfg, cfg.federation, federation, sender
        self.progress, self.clock, self.limits, self.topics, self.signer = progress, clock, limits, topics, signer
        self.inbox, self.publishing, self.secure, self.versions = inbox, publishing, secure, versions
        self.calibration = calibration
        self.privacy, self.norms, self.quarantine, self.registry = privacy, norms, quarantine, registry
        self.counters, self.metrics, self.exporter, self.wire = counters, metrics, exporter, wire
        self.resubscribe, self.on_round, self.on_progress = resubscribe, on_round, on_progress
        self.journal_dir = cfg.state_dir / "journal"
        self.resumed = False  # the open round was replayed from the journal: its plan is journaled already
        self.finished = False  # the final model and plan are out
        self.budget_stop: str | None = None  # why target_epsilon ended the federation

    @property
    def open(self) -> OpenRound | None:
        """The round in progress (kept by the inbox, which counts refusals into its metrics)."""
        return self.inbox.open

    def identity(self) -> dict[str, Any]:
        return identity(self.cfg, self.privacy, self.versions is not None, self.federation)

    # ---- start-up: checkpoint and journal -------------------------------------------------------
    def restore(self) -> None:
        """The checkpoint's progress and the journal of the round it stopped in."""
        p, cfg = self.progress, self.cfg
        ckpt = load_checkpoint(cfg.state_dir, self.identity())
        if ckpt is None and cfg.initial_model is not None:
            p.global_state = load_initial_model(cfg.initial_model, p.strategy.new_model())
            log.info("first global model from %s", cfg.initial_model)
        elif ckpt is None:
            p.global_state = initial_global_state(p.strategy, cfg.run.seed)
        else:
            p.done_round, p.global_state = ckpt.round, ckpt.global_state
            self.counters.update(ckpt.counters)
            self.norms.add(ckpt.norms, ckpt.norm_clients)
            self.secure.excluded.update(ckpt.excluded)  # proven faulty: still left out
            if self.privacy is not None:
                try:
                    self.privacy.restore(ckpt.privacy, ckpt.round)
                except ValueError as exc:
                    raise CheckpointError(f"checkpoint in {cfg.state_dir}: {exc}") from None
            if self.versions is not None and ckpt.window:
                try:
                    self.versions.restore_window(ckpt.window)
                except (TypeError, ValueError, AttributeError) as exc:
                    raise CheckpointError(f"checkpoint in {cfg.state_dir}: unreadable version window ({exc})") \
                        from None
            self.calibration.done = True  # a checkpoint exists only after a calibration (if any)
            if ckpt.options != p.options:  # options a calibration resolved
                p.options = ckpt.options
                p.strategy = make_strategy(cfg.run.strategy, cfg.spec, cfg.run.train, ckpt.options)
            log.info("resuming after round %d from %s", ckpt.round, cfg.state_dir)
        p.model = model_blob(p.global_state)
        if ckpt is not None and ckpt.model_digest not in ("", p.model.digest):
            raise CoordinatorError(f"checkpoint in {cfg.state_dir} does not match its recorded digest")
        p.accepted_before = folded_in(self.journal_dir, range(max(1, p.done_round - 2), p.done_round + 1))
        if p.done_round >= cfg.run.rounds:
            return
        try:
            found = journaled_round(self.journal_dir, p.done_round + 1, self.limits, p.model.digest)
        except RuntimeError as exc:
            raise CoordinatorError(str(exc)) from None
        holders = list((ckpt.window if ckpt is not None else {}).get("slots") or [])
        if found is not None and found[0].secure:  # keys and shares were in the devices' memory only: abandoned
            rnd = self.inbox.open = self.begin(found[0].round, found[0].selected)
            rnd.open_journal(self.journal_dir)
            assert rnd.secure is not None
            self.close(self.secure.close(rnd, rnd.secure.abandon_early(
                "the coordinator restarted during the round's protocol; a secure round is never resumed")))
            return
        if found is not None:
            plan, replay = found
            holders = list(plan.selected)  # the last plan's: the slots held when it stopped
            rnd = self.inbox.open = self.begin(plan.round, plan.selected)
            if self.versions is not None:  # every device a plan of this version offered a slot
                self.versions.window.offer(journaled_selection(replay, self.limits))
            self.resumed = True
            log.info("replayed %d journaled update(s) of round %d", rnd.replay(replay, self.quarantine), plan.round)
            rnd.open_journal(self.journal_dir)  # cuts a torn tail; re-sent updates may arrive at once
        if self.versions is not None and holders:  # coordinator.async_rounds, rule 4
            self.versions.restore_slots(holders, found is not None, self.clock())

    # ---- opening a round ------------------------------------------------------------------------
    def begin(self, number: int, selected: tuple[str, ...] | list[str]) -> OpenRound:
        """Round ``number``'s open aggregate (and its secure protocol); :meth:`start` opens it."""
        p = self.progress
        model = p.current_model()
        bound = self.norms.bound(self.fs.norm_bound, p.global_state)
        if self.secure.enabled:  # masked inputs have no norm to bound here: the devices clip before masking
            log.info("round %d: secure round: the devices clip their updates to the bound before masking; only the "
                     "sum is checked (docs/explanation/secure-aggregation.md)", number)
        else:
            log.info("round %d: update norm bound %s", number, "none" if bound is None else f"{bound:.4g}")
        # asynchronous: the buffer of version `number`, updates from recent versions are taken
        bases = self.versions.begin(number, model.digest, selected) if self.versions is not None else None
        if self.privacy is not None:  # the participation schema's history (coordinator.privacy, rule 3a)
            self.privacy.selected(number, selected)
        rnd = OpenRound.begin(number, selected, p.strategy, p.global_state, model.digest, self.fs, self.federation,
                              self.limits, self.clock(), bound, bases,
                              self.privacy.round(len(selected)) if self.privacy else None)
        if self.versions is not None:
            rnd.on_fold = self.versions.window.fold
            rnd.stats.mode = "async"
        if self.secure.enabled:  # coordinator.secure_phase: the round's protocol, a fresh session
            self.secure.open(rnd, p.strategy, p.global_state,
                             lambda opened, deadline: p.close_by(self.fs, opened, deadline, False))
        return rnd

    def start(self, rnd: OpenRound | None = None) -> None:
        """Open ``rnd`` (else the round begun already): its timer, model, journaled plan and plan."""
        if rnd is not None:
            self.inbox.open = rnd
        rnd = self.open
        assert rnd is not None
        now = self.clock()
        rnd.stats.wire_from = self.wire.snapshot()
        rnd.start_timer(self.fs, now)
        self.publishing.model(rnd.number, rnd)
        if rnd.journal is None:
            rnd.open_journal(self.journal_dir)
        assert rnd.journal is not None
        if not self.resumed:  # the plan is journaled before it goes out: a restart selects the same devices
            rnd.journal.append_plan(self._signed_plan(rnd))
        self.resumed = False
        self.publishing.publish_plan("train", rnd)
        if self.versions is not None:
            self.versions.pacer.opened(rnd.number, now)
        self.publishing.publisher.clear_old_models()
        log.info("round %d open: %d selected %s, deadline in %.0f s, %d already accepted", rnd.number,
                 len(rnd.selected), sorted(rnd.selected), self.fs.deadline_s, len(rnd.accepted))
        if self.on_progress is not None:
            self.on_progress("open", {"round": rnd.number, "selected": len(rnd.selected),
                                      "accepted": len(rnd.accepted)})

    def _signed_plan(self, rnd: OpenRound) -> bytes:
        return encode_message(self.publishing.plan("train", rnd), self.topics.federation, self.sender, key=self.signer)

    def replan(self) -> None:
        """The open round's holders changed (asynchronous rounds): one journal record, one plan publication."""
        rnd = self.open
        assert rnd is not None and rnd.journal is not None
        rnd.journal.append_plan(self._signed_plan(rnd))
        self.publishing.publish_plan("train", rnd)

    def cohort(self, online: list[str], number: int) -> list[str] | None:
        """Round ``number``'s devices (synchronous rounds): over-selected among those of ``online`` the participation
        schema allows (coordinator.privacy, rule 3a); None: too few of them, the federation ended."""
        pool = self.privacy.eligible(online, number) if self.privacy is not None else online
        if self.privacy is not None and self.schema_stop(len(pool), number):
            return None
        return select_devices(pool, self.fs.quorum, self.fs.over_selection, self.cfg.run.seed, number)

    def schema_stop(self, eligible: int, number: int) -> bool:
        """Too few online devices the participation schema allows for round ``number`` (coordinator.privacy,
        rule 3a): the federation ends."""
        why = None if self.privacy is None else self.privacy.schema_stop(eligible, self.fs.quorum, number)
        if why is None:
            return False
        log.warning("%s", why)
        self.budget_stop = why
        self.finish()
        return True

    def over_budget(self, number: int, selected: list[str]) -> bool:
        """Round ``number`` would exceed ``target_epsilon``, or delta 1/N for the devices that reported
        (coordinator.privacy, rule 2): the federation ends."""
        why = None if self.privacy is None else self.privacy.population_problem(len(self.registry)) \
            or self.privacy.over_budget(number, len(selected))
        if why is None:
            return False
        log.warning("%s", why)
        self.budget_stop = why
        self.finish()
        return True

    # ---- closing -------------------------------------------------------------------------------
    def checkpoint(self, number: int, window: dict[str, Any], private: dict[str, Any],
                   excluded: dict[str, str]) -> None:
        p = self.progress
        save_checkpoint(self.cfg.state_dir, Checkpoint(number, p.global_state, p.current_model().digest,
                                                       self.identity(), dict(self.counters), dict(p.options),
                                                       self.norms.norms, window, self.norms.clients, private,
                                                       excluded))

    def calibrate(self, online: list[str]) -> None:
        """Open round 0: the initial model and a ``calibrate`` plan for every device online."""
        cal = self.calibration.open(online, self.clock(), self.progress.strategy)
        self.publishing.model(0, None)
        self.publishing.publisher.plan(self.publishing.plan("calibrate", None, cal))
        log.info("calibration (round 0) open: %d devices %s", len(online), online)
        if self.on_progress is not None:
            self.on_progress("calibrate", {"selected": len(online)})

    def resolve_calibration(self) -> None:
        """Round 0's result: the strategy and options of every later round, checkpointed as round 0."""
        try:
            strategy, resolved, reports = self.calibration.resolve(self.progress.strategy)
        except (CalibrationError, ValueError) as exc:
            raise CoordinatorError(str(exc)) from None
        self.progress.strategy = strategy
        self.progress.options = {**self.progress.options, **resolved}
        self.checkpoint(0, {}, {}, {})
        log.info("calibration resolved %s from %d report(s)", resolved, reports)
        if self.on_progress is not None:
            self.on_progress("calibrated", {"resolved": resolved, "reports": reports})

    def close(self, reason: str) -> None:
        rnd, p = self.open, self.progress
        assert rnd is not None
        r = rnd.number
        old_state, old_model = p.global_state, p.model
        withheld = self.privacy.withheld(rnd.aggregate) if self.privacy is not None else None
        if withheld is not None:  # a local-mode round short of min_updates past the target: nothing published
            log.warning("round %d: %s", r, withheld)
            rnd.aggregate.withhold()
        p.global_state, left_out = rnd.close(self.quarantine)
        if self.privacy is not None and withheld is None:  # rule 5 of coordinator.privacy: post-processing
            p.global_state = self.privacy.step.apply(old_state, p.global_state)
        if left_out:
            self.counters["quarantined"] += len(left_out)
        self.norms.add(rnd.norms, rnd.norm_clients)
        # thin links: the delta from the previous model (lossy: the new model is its reconstruction)
        p.global_state, p.model = self.publishing.deltas.advance(old_model, old_state, p.global_state, r + 1)
        p.done_round = r
        p.accepted_before = {k: v for k, v in p.accepted_before.items() if k >= r - 2}
        p.accepted_before[r] = set(rnd.accepted)
        asynchronous = self.versions is not None
        # unfinished blobs are counted in this round's metrics (async: those still young enough stay)
        self.inbox.round_closed(r, r + 1 - self.fs.staleness_bound if asynchronous else None)
        dp = self.privacy.close(rnd.aggregate) if self.privacy is not None else {}  # composed, then checkpointed
        self.checkpoint(r, self.versions.record() if self.versions is not None else {},
                        self.privacy.state() if self.privacy is not None else {}, dict(self.secure.excluded))
        self.resubscribe()  # the broker re-sends what is retained under update/ and metrics/: cleared
        rnd.stats.wire_to = self.wire.snapshot()
        record = {**rnd.stats.as_dict(self.clock(), reason, self.counters, rnd.accepted), **dp}
        # the plan's close_by aims for quorum + grace: a round that waited for announced uploads counts to there
        base = rnd.timer.quorum_at + rnd.timer.grace_s - rnd.timer.opened_at \
            if rnd.timer is not None and rnd.timer.quorum_at is not None and not asynchronous else float("inf")
        p.durations = [*p.durations[-4:], min(float(record["wall_s"]), base)]
        self.metrics.write(record)
        self.exporter.round_closed(record)  # the same record: the scrape and the file agree
        p.history.append(record)
        prune_journals(self.journal_dir, r, self.fs.keep_journals)
        self.inbox.open = None
        log.info("round %d closed (%s): %d accepted%s", r, reason, record["accepted"], closing_notes(record))
        if self.on_round is not None:
            self.on_round(record)

    def finish(self) -> None:
        """Publish the final model and a ``final`` plan (retained), save the global model, end."""
        p = self.progress
        model = p.current_model()
        self.publishing.model(self.cfg.run.rounds + 1, self.open)
        self.publishing.publisher.plan(self.publishing.plan("final", None))
        self.publishing.publisher.clear_old_models()
        meta = {"strategy": p.strategy.name, "rounds": self.cfg.run.rounds, "seed": self.cfg.run.seed,
                "role": "global", "digest": model.digest}
        save_model(self.cfg.state_dir / "global.safetensors", p.global_state, self.cfg.spec, meta)
        self.finished = True
        log.info("federation finished after round %d; final model %s", p.done_round, model.digest[:12])

